// CPU loops of the activation family's targets (see activation/problem.h for the problems'
// layout), called by its CPU backend (run.h).
//
// act_lu      y = act(x) (gated: act(x[r, 0, :]) * lin(x[r, 1, :])), rounded once to x's dtype;
//             with p.amax, also max|y| over the rounded outputs as float32 (NaN if any is NaN).
// dact_dbias  dx = act'(x) * dz (gated: dA and dB, docs/numerics.md §1), rounded once to x's
//             dtype; with p.dbias, dbias[b] = the float32 sum over batch b's rows of the unrounded dx,
//             computed as per-(batch, row group) partial sums in p.workspace, then summed over the
//             groups in order: bit-identical whatever the number of threads or the scheduling;
//             with p.amax, max|dx| over the rounded dx.
//
// Rows are split over `pool` (may be nullptr: everything runs on the calling thread).
#pragma once

#include "activation/problem.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax::cpu {

void act_lu(const ActLuProblem& p, ::xla::ffi::ThreadPool* pool);
void dact_dbias(const DActProblem& p, ::xla::ffi::ThreadPool* pool);

// The generic path (quantized.cc): problems with `quantized` set (scaled modes, amax passes).
void act_lu_quantized(const ActLuProblem& p, ::xla::ffi::ThreadPool* pool);
void dact_dbias_quantized(const DActProblem& p, ::xla::ffi::ThreadPool* pool);

// Blockwise FP8 (fp8_block.cc): problems with `quantized` set and q.emit == FP8_BLOCK.
void act_lu_fp8_block(const ActLuProblem& p, ::xla::ffi::ThreadPool* pool);
void dact_dbias_fp8_block(const DActProblem& p, ::xla::ffi::ThreadPool* pool);

}  // namespace te_jax::cpu
