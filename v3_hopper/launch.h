// What v3_api.cu hands one forward instance: the tensor maps it encoded on the host and the persistent grid size.
// Host-compilable; the instances are defined in fwd_launch.cuh and generated per (dtype, head-dim bucket).
#pragma once

#include <cuda.h>  // CUtensorMap (a type only; nothing links libcuda)
#include <cuda_runtime_api.h>

#include "common/params.h"
#include "common/status.h"
#include "v3_hopper/tile_config.h"

namespace flashgen {
namespace v3 {

struct FwdLaunch {
  CUtensorMap q, k, v;  // 4-D (head_dim, rows, heads, batches) maps, boxes of tile_config.h's tile rows
  CUtensorMap o;        // the output map (16-bit), boxes of 64 rows (tile_config.h o_through_smem)
  bool o_tma = false;   // FP8: `o` was made (the output's pointer and strides suit TMA); the 16-bit forward requires it
  int grid;             // CTAs: min(tiles, SMs)
  bool masked;          // the masked instance's code: a window, the short tile or a split
  // 16-bit: the masked code on short_tile_config (tile_config.h fwd_short_tile); with split, the packed rows' split
  // tile (has_packed_split_tile)
  bool short_tile = false;
  bool split = false;   // 16-bit: the split-KV instance and the combine (p.num_splits > 1, v3_api.cu plan_fwd)
  int block_n = 0;      // FP8: the key tile the K / V maps were made for (fp8_tile_config)
  TileOrder order = {};  // the persistent grid's tile order (tile_config.h make_tile_order, choose_tile_group)
};

// The tile order of one launch: the kernels' rule for a causal-like order (window_left < 0 <= window_right) and
// choose_tile_group's group, remembered for the last few shapes (it simulates the order on the host, up to ~1 ms for
// the largest of the bench grid's shapes; a model repeats the same few). element_bytes: of q, k, v (2, or 1 for FP8).
TileOrder launch_tile_order(const AttnParams& p, int block_m, int element_bytes, int grid);

// The map of the forwards' TMA stores of O (16-bit `dtype`): O's rows as Q's (varlen stacked), boxes of one consumer
// warpgroup's 64 rows and 64 columns (consumer.cuh store_o_smem). Needs `out` 16-byte aligned with strides of
// multiples of 8 elements (host_checks.h check_rows_aligned).
Status encode_output_map(CUtensorMap* map, const AttnParams& p, DType dtype);

template <typename Tag, int kHeadDim>
Status launch_fwd(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream);
// The forward whose V has its own head-dim bucket kHeadDimV (tile_config.h value_tile_config; instances of kind
// fwd_v<kHeadDimV>, v3_hopper/CMakeLists.txt FLASHGEN_V3_VALUE_HEAD_DIMS).
template <typename Tag, int kHeadDim, int kHeadDimV>
Status launch_fwd_value(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream);

struct BwdLaunch {
  CUtensorMap q, dout;  // boxes of the backward's block_m rows (tile_config.h bwd_tile_config)
  CUtensorMap k, v;     // boxes of block_n rows
  bool dq_rows = false;  // the d64 dq_rows tile (tile_config.h bwd_dq_rows_tile), whose block_m the boxes have
  int tail_group = 1;    // head-batches interleaved at the end of the grid (common/cta_order.h grid_tail_group)
  BwdTail tail;          // the last CTAs cut into pieces (tile_config.h bwd_tail_plan; v3_api.cu bwd_tail_for)
};

// The backward launch has a score modifier (softcap or ALiBi): bwd_kernel's kMods instance, and never the d64
// dq_rows tile (tile_config.h bwd_dq_rows_tile).
inline bool bwd_has_mods(const AttnBwdParams& p) { return p.softcap > 0.f || p.alibi_slopes != nullptr; }

template <typename Tag, int kHeadDim>
Status launch_bwd(const AttnBwdParams& p, const BwdLaunch& launch, cudaStream_t stream);
// The backward whose V (dO, dV) has its own head-dim bucket kHeadDimV (tile_config.h bwd_value_tile_ok; instances of
// kind bwd_v<kHeadDimV>, v3_hopper/CMakeLists.txt FLASHGEN_V3_VALUE_HEAD_DIMS).
template <typename Tag, int kHeadDim, int kHeadDimV>
Status launch_bwd_value(const AttnBwdParams& p, const BwdLaunch& launch, cudaStream_t stream);

}  // namespace v3
}  // namespace flashgen
