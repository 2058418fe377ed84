/*
 * expert_32.c — an expert written the reference design's way: plain C, no Colibri header,
 * one exported function, built with
 *
 *     gcc -shared -fPIC -O2 -o expert_32.so expert_32.c -lm
 *
 * Such a .so has no metadata, so the engine refuses it alone. Drop it as a bundle, a
 * folder expert_32.expert/ holding it, expert.toml and router_row.npy (docs/HOTPLUG.md,
 * "A bundle"), or make it a regular expert with
 *
 *     colibri expert build --from-c expert_32.c --router-row row.npy --layer 1
 *
 * The contract (docs/HOTPLUG.md): x and y are [n_tokens, hidden] float32 rows; overwrite
 * every value of y, rows independent, return 0 on success. Works for any hidden size.
 */
#include <math.h>

int ffn_forward(const float *x, float *y, int n_tokens, int hidden)
{
    if (n_tokens < 1 || hidden < 1)
        return 1;
    for (long t = 0; t < n_tokens; t++) {
        const float *xr = x + t * (long)hidden;
        float *yr = y + t * (long)hidden;
        float mean = 0.0f;
        for (int i = 0; i < hidden; i++)
            mean += xr[i];
        mean /= (float)hidden;
        for (int i = 0; i < hidden; i++)            /* a gated, centred response */
            yr[i] = 0.5f * tanhf(xr[i] - mean) / (1.0f + expf(-xr[i]));
    }
    return 0;
}
