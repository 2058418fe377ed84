"""transformers (PyTorch CPU, float32) runner for bench_vs_llamacpp.py (own process; JSON
job on argv[1]). Loads the 16-bit safetensors checkpoint into float32: this is also the
fidelity reference ("the 16-bit model")."""
from __future__ import annotations

import numpy as np

from benchmarks.peers._peer_common import emit, job, time_peer


def main():
    j = job()
    import torch
    import transformers as tr
    torch.set_num_threads(j["threads"])
    model = tr.AutoModelForCausalLM.from_pretrained(j["model"], dtype=torch.float32).eval()
    if j["mode"] == "logits":
        with torch.inference_mode():
            out = np.stack([model(torch.tensor([p])).logits[0].float().numpy() for p in j["prompts"]])
        np.save(j["out"], out)
        emit({"engine": "transformers", "shape": list(out.shape)})
        return

    @torch.inference_mode()
    def stream(prompt, n):
        out = model(torch.tensor([prompt]), use_cache=True)
        past = out.past_key_values
        tok = int(out.logits[0, -1].argmax())
        yield tok
        for _ in range(n - 1):
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = int(out.logits[0, -1].argmax())
            yield tok

    res = time_peer(stream, j)
    emit({"engine": "transformers", "dtype": "float32", **res})


if __name__ == "__main__":
    main()
