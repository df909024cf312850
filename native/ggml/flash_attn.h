// dflash-local: ggml's CPU flash attention with the same bits for a row whatever batch it is in (flash_attn.c)
#pragma once

#include "ggml.h"

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

// Computes dst (GGML_OP_FLASH_ATTN_EXT) and returns true, or returns false where this build has no kernel for its
// types and head sizes (ggml's one-row kernel then computes it, for every batch alike).
bool dflash_flash_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst);

// A marker: this build's flash attention gives a row the same bits whatever the batch (Engine's bit_exact_verify).
bool dflash_flash_attn_batch_invariant(void);

#ifdef __cplusplus
}
#endif
