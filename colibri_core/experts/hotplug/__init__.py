"""Hot-plugged experts: .so files dropped into a watched folder, checked, probed, adopted.

Modules (each importing only those above it):

    errors.py    typed errors (ValueError / RuntimeError subclasses) with a `reason` code
    elf.py       ELF64 reader: headers, sections, segments, symbols, vaddr -> file offset
    meta.py      colibri_expert_meta (include/colibri_expert.h) read from the file, checked
                 (ABI 2: base_model, the model it was built for; fingerprint.py)
    staging.py   ownership/permission checks, the first open (O_NOFOLLOW | O_NONBLOCK),
                 private staging copy named by sha256
    bundle.py    bundle folders NAME.expert/ (ffn_forward-only .so + expert.toml + row)
    state.py     the JSON state file (slots, versions, history), written atomically
    probecheck.py  the checks a probe runs on a .so (calls of ffn_forward), in its process
    probe.py     the probe's processes and verdicts: the warm helper that forks one child
                 per probe (`python -m colibri_core.experts.hotplug.probe --serve`), the
                 fresh-interpreter fallback, interpret()
    probepool.py ProbePool: the helper seen from the engine, P probes at once, restarts
    sandbox.py   the isolated helper's seccomp filter (before the expert is loaded) and
                 its descriptors
    isolated.py  isolated mode: ffn_forward in a helper process over shared memory
    stagedmap.py the staged copy mapped under the SIGBUS guard; releasing experts
    expert.py    HotExpert, ExpertChange, Q4Weights, LoadedExpert (dlopen, on the worker)
    inotify.py   inotify read directly: the raw masks (IN_MOVED_TO, IN_CLOSE_WRITE...)
    watcher.py   the folder's watch: queues paths and how they arrived, nothing else
    listing.py   list()'s rows, rollback's names (metadata name or file), and the
                 read-only view of a folder a running engine holds (state file + folder)
    book.py      the manager's book: names, slots, versions, the active set, the state
                 file, refusals (one rule), rollback's target; no thread
    checking.py  the intake's checks of one file: check, stage, probe, load, queue
    intake.py    the manager's intake: the watch and the worker thread (settling, the
                 checks, batches for drain(), housekeeping)
    adoption.py  the manager's engine side: drain(), preview(), the releases
    manager.py   HotplugManager: the three parts under one lock, the API
    events.py    the history of expert changes and their one INFO line each (the engine
                 records them once live, with the expert-set generation)
    authoring/   writing experts: builder.py (`colibri expert build`: .npz -> INT4 +
                 .incbin + C fallback -> .so, bound to a model or --portable; --from-c),
                 buildsrc.py (the sources it generates), testing.py (a C test expert
                 with switchable faults, for tests and benchmarks)

Names are imported lazily, so that `python -m colibri_core.experts.hotplug.probe` (the probe and
its helper) and the isolated helper start without importing numpy or watchdog. See
docs/HOTPLUG.md.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "HotplugManager": "manager",
    "HotExpert": "expert", "ExpertChange": "expert", "Q4Weights": "expert",
    "INPROCESS": "expert", "ISOLATED": "expert",
    "build_expert": "authoring.builder", "compile_shared": "authoring.builder",
    "include_dir": "authoring.builder",
    "read_expert_file": "meta", "ExpertMeta": "meta", "ExpertFileInfo": "meta",
    "ABI_VERSION": "meta",
    "ElfFile": "elf",
    "bundle_identity": "bundle", "read_bundle": "bundle", "build_from_c": "authoring.builder",
    "run_probe": "probe", "ProbePool": "probepool",
    "HotplugError": "errors", "ExpertRejected": "errors", "ElfFormatError": "errors",
    "ExpertIncomplete": "errors", "ArchitectureMismatch": "errors",
    "ExpertAbiError": "errors", "ExpertMetadataError": "errors",
    "ExpertSecurityError": "errors", "ExpertProbeError": "errors",
    "ExpertForwardError": "errors", "ExpertCrashed": "errors", "ExpertReleased": "errors",
    "ExpertBuildError": "errors", "RollbackError": "errors", "HotplugStateError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
