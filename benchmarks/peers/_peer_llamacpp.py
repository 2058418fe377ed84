"""llama.cpp runner (through llama-cpp-python) for bench_vs_llamacpp.py (own process;
JSON job on argv[1]). Greedy: argmax over llama_get_logits_ith(ctx, -1) after each
Llama.eval (one llama_decode per call; the 64-token prompt is one batch)."""
from __future__ import annotations

import numpy as np

from benchmarks.peers._peer_common import emit, job, time_peer


def main():
    j = job()
    import llama_cpp
    logits_all = j["mode"] == "logits"
    llm = llama_cpp.Llama(model_path=j["model"], n_ctx=512, n_batch=512, n_ubatch=512,
                          n_threads=j["threads"], n_threads_batch=j["threads"],
                          logits_all=logits_all, use_mmap=True, verbose=False)
    V = llm.n_vocab()
    info = {"system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            "version": getattr(llama_cpp, "__version__", "?")}
    if logits_all:
        out = []
        for p in j["prompts"]:
            llm.reset()
            llm.eval(p)
            out.append(np.array(llm.scores[:len(p)], np.float32))
        out = np.stack(out)
        np.save(j["out"], out)
        emit({"engine": "llama.cpp", "shape": list(out.shape), **info})
        return
    ctx = llm._ctx.ctx

    def argmax_last() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(V,))))

    def stream(prompt, n):
        llm.reset()
        llm.eval(prompt)
        tok = argmax_last()
        yield tok
        for _ in range(n - 1):
            llm.eval([tok])
            tok = argmax_last()
            yield tok

    res = time_peer(stream, j)
    emit({"engine": "llama.cpp", **res, **info})


if __name__ == "__main__":
    main()
