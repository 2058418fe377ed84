"""Colibri runner for bench_vs_llamacpp.py (own process; JSON job on argv[1])."""
from __future__ import annotations

import numpy as np

from benchmarks.peers._peer_common import Profiler, decode_profiled, emit, job, time_stream


def main():
    j = job()
    from colibri_core.engine import Engine
    # the model's files are read in at load, as llama.cpp's loader reads (and repacks)
    # its weights before the first token: neither engine's timing includes disk reads
    eng = Engine.from_model_dir(j["model"], threads=j["threads"], preload="populate")
    if j["mode"] == "logits":
        out = np.stack([eng.next_token_logits(p, all_positions=True).astype(np.float32)
                        for p in j["prompts"]])
        np.save(j["out"], out)
        emit({"engine": "colibri", "shape": list(out.shape)})
        return
    eng.generate(j["warmup"], max_new_tokens=4, temperature=0).run()
    n = j["tokens"]

    def stream():
        for ev in eng.generate(j["prompt"], max_new_tokens=n, temperature=0):
            yield ev.token_id

    prof = Profiler(j.get("profile"))
    with prof:
        res = time_stream(decode_profiled(stream(), prof))
    if j.get("profile_prefill"):          # the first token alone: prefill + one sample
        import cProfile
        pr = cProfile.Profile()
        pr.enable()
        eng.generate(j["prompt"], max_new_tokens=1, temperature=0).run()
        pr.disable()
        pr.dump_stats(j["profile_prefill"])
    emit({"engine": "colibri", **res})


if __name__ == "__main__":
    main()
