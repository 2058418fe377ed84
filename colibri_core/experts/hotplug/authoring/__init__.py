"""Authoring hot-pluggable experts (not used by a running engine):

    buildsrc.py  the C and assembler sources the builder generates
    builder.py   `colibri expert build`: .npz -> INT4 + .incbin + C fallback -> .so,
                 bound to a model (--config/--model/--base-model) or --portable; and
                 --from-c, a reference-design source made a regular expert
    testing.py   a C test expert with switchable faults (segv, hang, nan...), for tests
                 and benchmarks

They write what the rest of hotplug/ reads (meta.py's record, bundle.py's layout) and
check their output the way the engine will (meta.read_expert_file). See docs/HOTPLUG.md,
"Writing an expert".
"""
