// v3 forward tile table: the one place tile sizes, thread roles and register budgets live. Host dispatch (tensor-map
// box sizes, shared memory, grid) and the kernel traits both read it. Host-compilable (no CUDA headers).
#pragma once

#include "common/config.h"
#include "common/row_divider.h"
#include "common/split_kv.h"

namespace flashgen {
namespace v3 {

// ---- thread roles: warpgroup 0 produces (TMA), warpgroups 1..consumers consume (wgmma + softmax) ----
constexpr int kWarpSize = 32;
constexpr int kWarpgroupThreads = 128;   // wgmma is issued by 4 consecutive warps
constexpr int kWarpgroupRows = 64;       // wgmma M: query rows per consumer warpgroup
constexpr int kMaxConsumerWarpgroups = 3;

// ---- shared-memory layout unit: 128-byte swizzle, as written by TMA (CU_TENSOR_MAP_SWIZZLE_128B) and read by
// wgmma (descriptor layout 1). A tile (rows, head_dim) is stored as head_dim / 64 column chunks, each chunk
// rows x 128 bytes; rows come in 1024-byte groups of 8 whose 16-byte pieces are XOR-swizzled by row % 8.
constexpr int kElementBytes = 2;                           // fp16 / bf16
constexpr int kSwizzleBytes = 128;                         // one row of a chunk
constexpr int kChunkCols = kSwizzleBytes / kElementBytes;  // 64 elements
constexpr int kSwizzleAtomBytes = 8 * kSwizzleBytes;       // 8 rows: the period of the swizzle pattern
constexpr int kMaxSmemPerBlock = 227 * 1024;               // sm_90 opt-in limit per block

// consumers: consumer warpgroups, each owning 64 query rows (block_m = 64 x consumers); block_n: keys per K/V tile
// (the N of S = Q K^T, the K of O += P V); stages: K and V shared-memory buffers each (TMA ring on mbarriers);
// pingpong: the consumer warpgroups take turns issuing their GEMMs (named barriers), so one's softmax runs under
// the others' GEMMs (FA3 Sec. 3.1).
struct TileConfig {
  int consumers, block_n, stages;
  bool pingpong;
};

// `masked`: the launch has a window (causal or local), so the tile sees a diagonal; the two instances differ in their
// mask code, not in their tiles. Starting points from FA3's own sm90 table (hopper/tile_size.h: d64 192 x 128 with
// three consumer warpgroups, d128 128 x 176 without a window and 128 x 128 with one, d192 128 x 112, d256 128 x 80;
// ping-pong up to d128), sized by shared memory (Q + 2 x stages x block_n rows must fit 227 KB). Measured on the H200
// with the first tile table (results/2026-12-01-time-run1, bf16 8k, ratio to SDPA cuDNN): d64 128 x 128 x 2
// warpgroups 0.82-0.84 (softmax-bound: a d64 GEMM is half of d128's for the same exponentials, so a third
// warpgroup's softmax must hide behind two GEMMs), d128 128 x 128 0.83-0.95, d256 0.97-1.06.
// d128 without a window: 128 keys, as FlashAttention-4's sm90 table, since session 59. The 176-key tile leaves the
// last block of a sequence partly empty (4096 keys: 23.3 blocks, 3% of the work wasted; 512: 3 x 176 = 528 columns)
// and no room for O's shared-memory stage; each tile has a fixed cost (S_0 and its softmax with nothing of the
// warpgroup's own under them, the closing P V, the epilogue) that grows with the key block. H100, medians of 3-4
// rounds in three calls, cuDNN in each row (bench/NOTES.md session 59): 512 478 -> 496 TFLOP/s, 1k +1.5-2%, 4k
// +4.5-5% (624 -> 653), 2k and 8k even, 16k -1.5%. On the H200 the 128-key tile had measured within the spread of
// the 176 one at 2k-8k (sessions 14, 29, 30).
constexpr TileConfig tile_config(int head_dim, [[maybe_unused]] bool masked) {
  if (head_dim <= 64) return {3, 128, 3, true};
  if (head_dim <= 128) return {2, 128, 2, true};
  if (head_dim <= 192) return {2, 112, 2, false};
  return {2, 80, 2, false};
}

// Keys a query row sees on average: seqlen_k without a window; causal (bottom-right) about seqlen_k - seqlen_q / 2; a
// window at most left + right + 1 (left-bounded only: left + seqlen_q / 2 + 1). seqlen_q / seqlen_k: the padded maxima
// for varlen. Host-side tile choices read it (fwd_short_tile below, fp8_config.h fp8_wide_tile).
constexpr int64_t mean_row_keys(int64_t seqlen_q, int64_t seqlen_k, int window_left, int window_right) {
  int64_t keys = seqlen_k;
  if (window_right >= 0) {  // right-bounded: the rows' last keys run from seqlen_k - seqlen_q + window_right up
    const int64_t last_mid = seqlen_k - seqlen_q / 2 + window_right;
    keys = last_mid < keys ? last_mid : keys;
  }
  if (window_left >= 0 && window_right >= 0) {
    const int64_t span = static_cast<int64_t>(window_left) + window_right + 1;
    keys = span < keys ? span : keys;
  } else if (window_left >= 0) {
    const int64_t span = static_cast<int64_t>(window_left) + seqlen_q / 2 + 1;  // left-bounded only
    keys = span < keys ? span : keys;
  }
  return keys;
}

// A third tile, with the masked instance's code, for launches whose rows see few keys (v3_api.cu fwd): 64 keys at
// d192 (Q 48 + K / V 96 + O 48 KB: O through its own stage) and d256 (Q 64 + K / V 128 KB: O through Q's buffer,
// o_in_q below). Causal rows of a few key blocks waste less of the 64-key tile on the diagonal (512 causal: 89% of the
// computed scores are visible against 78% at d192's 112 keys and 82% at d256's 80, counted per 64-row warpgroup).
// d256 had a 48-key short tile from session 30 (when the 80-key tile still stored O from registers) to session 60.
// A/B on an H100 (session 60, 2 rounds, cuDNN in each row, rows that see at most 1024 keys on this tile, TFLOP/s):
// d192 512 444 -> 478 full / 232 -> 260 causal, 1k 555 -> 572 / 393 -> 416, 2k causal even; d256 (from the 80-key
// tile, or the 48-key one at 512 causal) 512 472 -> 486 / 278 -> 274, 1k full even, 1k causal 433 -> 442, 2k causal
// 556 -> 570. Rows that see at most kShortTileMaxRowKeys keys on average take it.
constexpr TileConfig short_tile_config(int head_dim) {
  return head_dim > 128 ? TileConfig{2, 64, 2, false} : tile_config(head_dim, true);
}
constexpr bool has_short_tile(int head_dim_bucket) {
  return short_tile_config(head_dim_bucket).block_n != tile_config(head_dim_bucket, true).block_n;
}
constexpr int64_t kShortTileMaxRowKeys = 1024;
constexpr bool fwd_short_tile(int head_dim_bucket, int64_t seqlen_q, int64_t seqlen_k, int window_left,
                              int window_right) {
  return has_short_tile(head_dim_bucket) &&
         mean_row_keys(seqlen_q, seqlen_k, window_left, window_right) <= kShortTileMaxRowKeys;
}

// Query blocks laid from seqlen_q down (the masked instances, kernel_traits.cuh tile_m_begin): block m starts at row
// m x block_m - query_row_shift, so the partial block, whose missing rows leave warpgroups idle for the whole tile, is
// the causal order's lightest (first) block instead of its heaviest (last). The shift is whole warpgroups, so a
// warpgroup's rows lie all before row 0 or none do. d64's 192-row blocks at 1k causal: -128, 64, .., 832 (the first
// block one warpgroup of rows and 1 key block) instead of 0, 192, .., 960 (the last one warpgroup and 8 key blocks):
// 270 -> 322 TFLOP/s (bench/NOTES.md session 31).
FH_HD constexpr int query_row_shift(int seqlen_q, int block_m) {
  const int pad = (seqlen_q + block_m - 1) / block_m * block_m - seqlen_q;  // rows past seqlen_q in the last block
  return pad - pad % kWarpgroupRows;
}

// A paged KV cache's rows per TMA box of K / V for tiles of block_n keys (producer.cuh load_paged_tile): gcd(page
// size, block_n), so that a tile is whole boxes and each box lies inside one page (tiles start at multiples of
// block_n, with no left pad). v3 takes pages where that is a multiple of the 128-byte swizzle's 8-row period (a box
// then lands on a whole swizzle atom): every page size that is a multiple of 8 with every tile here (block_n 64, 80,
// 112, 128: multiples of 16); v2 runs the others (pages of 1, 3, ...).
FH_HD constexpr int paged_box_rows(int page_block_size, int block_n) {
  int a = page_block_size, b = block_n;
  while (b != 0) {
    const int t = a % b;
    a = b;
    b = t;
  }
  return a;
}
constexpr int kPagedBoxRowMultiple = 8;
constexpr bool paged_box_ok(int page_block_size, int block_n) {
  return page_block_size > 0 && paged_box_rows(page_block_size, block_n) % kPagedBoxRowMultiple == 0;
}
// A table whose sequences each read one page (seqlen_k <= page_block_size: every key row lies in entry 0; the API's
// form of a left-padded dense cache, page = the capacity) needs no box inside a page: one box of block_n rows from
// any row (the left pad's), TMA zero-filling the rows past the page. Otherwise paged_box_rows's boxes, from rows that
// are multiples of block_n (no left pad).
FH_HD constexpr bool paged_one_page(int page_block_size, int seqlen_k) { return seqlen_k <= page_block_size; }
FH_HD constexpr int paged_tile_box_rows(int page_block_size, int seqlen_k, int block_n) {
  return paged_one_page(page_block_size, seqlen_k) ? block_n : paged_box_rows(page_block_size, block_n);
}
// The producer warps that load a paged cache's K / V tiles (producer.cuh load_paged_tile deals a tile's boxes to
// them): one per box, up to the producer warpgroup's 4. With one warp, pages of 16 rows (8 boxes a tile, 16 TMAs at
// d128, issued one after another) left the consumers waiting on K and V: 2.43 ms against 1.38 dense at 8k x 2048;
// two warps 2.04-2.07, four 1.84 (ncu; time_kvcache 398 -> 460 -> 486 TFLOP/s; bench/NOTES.md session 40). A tile of
// one box (pages of 128 rows and up) has one warp.
constexpr int kMaxPagedLoaderWarps = 4;
static_assert(kMaxPagedLoaderWarps * kWarpSize <= kWarpgroupThreads, "loader warps are the producer warpgroup's");
FH_HD constexpr int paged_loader_warps(int page_block_size, int seqlen_k, int block_n) {
  const int boxes = block_n / paged_tile_box_rows(page_block_size, seqlen_k, block_n);
  return boxes < kMaxPagedLoaderWarps ? boxes : kMaxPagedLoaderWarps;
}

// ---- ablation switches (FA3 paper Sec. 4.3): compile definitions, 1 (on) unless a measurement turns one off
// (tools/ablate_v3.sh builds one module per switch and times each against the default in one device call) ----
#ifndef FLASHGEN_V3_PINGPONG
#define FLASHGEN_V3_PINGPONG 1  // 0: consumer warpgroups issue their GEMMs whenever ready (no turn-taking)
#endif
#ifndef FLASHGEN_V3_OVERLAP
#define FLASHGEN_V3_OVERLAP 1  // 0: S = Q K^T, softmax, O += P V one after another inside a warpgroup
#endif
#ifndef FLASHGEN_V3_PERSISTENT
#define FLASHGEN_V3_PERSISTENT 1  // 0: one CTA per tile (grid = tiles) instead of one per SM looping over tiles
#endif
#ifndef FLASHGEN_V3_WARPSPEC
// 0: no producer warpgroup: the consumers' first thread issues the TMA loads between its own work (producer.cuh
// Loader::step<false>, polled while it waits for a buffer and after each release), no setmaxnreg, no ping-pong (a
// warpgroup blocked on its turn could not issue the loads the other one waits for)
#define FLASHGEN_V3_WARPSPEC 1
#endif
constexpr bool kWarpSpecialized = FLASHGEN_V3_WARPSPEC != 0;
constexpr bool kPingPongEnabled = FLASHGEN_V3_PINGPONG != 0 && kWarpSpecialized;
constexpr bool kIntraWarpgroupOverlap = FLASHGEN_V3_OVERLAP != 0;
constexpr bool kPersistentGrid = FLASHGEN_V3_PERSISTENT != 0;

constexpr int block_m(const TileConfig& c) { return c.consumers * kWarpgroupRows; }
// producer: the producer warpgroup is there (always but in the forward's no-warpspec ablation).
constexpr int num_threads(const TileConfig& c, bool producer = true) {
  return ((producer ? 1 : 0) + c.consumers) * kWarpgroupThreads;
}

// ---- register budgets (setmaxnreg): the SM's 64K registers split unevenly between the roles ----
// __launch_bounds__(threads, 1) starts every thread at launch_regs; the producer gives registers back to the CTA's
// pool and the consumers take them, so the producer must free at least what the consumers claim. FA3's budgets:
// 2 consumer warpgroups 24 / 240 (from 168), 3 consumer warpgroups 32 / 160 (from 128), one 56 / 256 (from 255: ptxas
// gives a 256-thread kernel 255, and setmaxnreg.inc may not lower a count).
constexpr int kRegisterFile = 65536;
constexpr int kRegisterGranule = 8;  // setmaxnreg counts and the per-thread allocation are multiples of 8
struct RegisterBudget {
  int producer, consumer;
};
constexpr RegisterBudget register_budget(const TileConfig& c) {
  if (c.consumers == 1) return {56, 256};  // only split_tile_config's one-warpgroup option has one
  return c.consumers == 2 ? RegisterBudget{24, 240} : RegisterBudget{32, 160};
}
constexpr int launch_regs(const TileConfig& c) {
  return kRegisterFile / num_threads(c) / kRegisterGranule * kRegisterGranule;
}
constexpr bool budget_fits(const TileConfig& c) {
  if (!kWarpSpecialized) return c.consumers >= 1 && c.consumers <= kMaxConsumerWarpgroups;  // no setmaxnreg
  return kWarpgroupThreads * (launch_regs(c) - register_budget(c).producer) >=
             c.consumers * kWarpgroupThreads * (register_budget(c).consumer - launch_regs(c)) &&
         c.consumers >= 1 && c.consumers <= kMaxConsumerWarpgroups;
}

// mbarriers: Q full/empty, then K full/empty and V full/empty per stage, 8 bytes each.
constexpr int barrier_count(int stages) { return 2 + 4 * stages; }
constexpr int kBarrierBytes = 8;

// Shared memory of the key loop: Q + stages x (K + V) tiles, the mbarriers, and slack to align the base to the
// swizzle atom (the dynamic shared-memory base is only guaranteed 16-byte alignment). value_bucket: V's head-dim
// bucket where V has its own (value_tile_config below), else the same as Q's and K's.
constexpr int smem_bytes_mainloop(const TileConfig& c, int head_dim_bucket, int value_bucket) {
  return ((block_m(c) + c.stages * c.block_n) * head_dim_bucket + c.stages * c.block_n * value_bucket) *
             kElementBytes +
         barrier_count(c.stages) * kBarrierBytes + kSwizzleAtomBytes;
}
constexpr int smem_bytes_mainloop(const TileConfig& c, int head_dim_bucket) {
  return smem_bytes_mainloop(c, head_dim_bucket, head_dim_bucket);
}
// O leaves through shared memory and TMA stores (FA3's and cuDNN's epilogue: stmatrix into a 128-byte-swizzled stage,
// one bulk store per 64-column chunk and warpgroup) where the tile leaves room for a (block_m, head_dim) stage beside Q
// and the K/V ring: d64 (120 + 24 KB), d128 (160 + 32 KB; the masked instance's only, before session 59) and d192's
// short tile (144 + 48 KB). d192's 112-key tile and d256's 80- and 64-key tiles fill 192-224 KB: there O's stage is Q's
// buffer (o_in_q below). For a varlen warpgroup whose rows cross its sequence's end, for a tile with no key blocks
// under o_in_q, and for d192 with V's head dim apart, O goes out from registers as 4-byte stores (consumer.cuh
// store_tile).
// Against those stores (session 30, 3 rounds, cuDNN in each row): d128 512-1k +5-7%, 2k +3-4.5%, 8k causal +1%; d64
// 512-1k +1.5-3.5%, 8k -0.5%.
#ifndef FLASHGEN_V3_TMA_STORE_O
#define FLASHGEN_V3_TMA_STORE_O 1
#endif
constexpr int o_stage_bytes(int rows, int head_dim_bucket) { return rows * head_dim_bucket * kElementBytes; }
// A kernel whose key loop takes `mainloop_bytes` stages O when `stage_bytes` more fit (fp8_config.h uses it too).
constexpr int with_o_stage(int mainloop_bytes, int stage_bytes) {
  return FLASHGEN_V3_TMA_STORE_O != 0 && mainloop_bytes + stage_bytes <= kMaxSmemPerBlock ? mainloop_bytes + stage_bytes
                                                                                       : mainloop_bytes;
}
// Shared memory of one CTA, and whether it holds O's stage (O has V's head dim).
constexpr int smem_bytes(const TileConfig& c, int head_dim_bucket, int value_bucket) {
  return with_o_stage(smem_bytes_mainloop(c, head_dim_bucket, value_bucket), o_stage_bytes(block_m(c), value_bucket));
}
constexpr int smem_bytes(const TileConfig& c, int head_dim_bucket) {
  return smem_bytes(c, head_dim_bucket, head_dim_bucket);
}
constexpr bool o_through_smem(const TileConfig& c, int head_dim_bucket, int value_bucket) {
  return smem_bytes(c, head_dim_bucket, value_bucket) != smem_bytes_mainloop(c, head_dim_bucket, value_bucket);
}
constexpr bool o_through_smem(const TileConfig& c, int head_dim_bucket) {
  return o_through_smem(c, head_dim_bucket, head_dim_bucket);
}
// Where no stage of its own fits (d192's 112-key and d256's 80- and 64-key tiles), O goes through Q's buffer, as in
// FlashAttention-4's sm90 forward (sO over sQ): each consumer warpgroup's O stage is its own 64 rows of the Q tile,
// written once its last S GEMM has read them; the warpgroup frees Q only after the stores have read the stage, and the
// producer loads the next tile's first K before its Q (producer.cuh), so Q's reload is the one load that waits for the
// epilogue. Against the register stores (H100, session 60, 2 rounds, cuDNN in each row, TFLOP/s): d192 512 418 -> 447
// full / 198 -> 240 causal, 1k 514 -> 559 / 358 -> 401, 2k 583 -> 641 / 497 -> 533, 8k 628 -> 708 / 628 -> 660; d256's
// 80-key tile 2k full 632 -> 677 (and it then beat the 48-key short tile at 1k, which led to the 64-key short tiles
// above). Needs the warp-specialized kernel (the producer's order) and V at q's head dim (Q's buffer holds kHeadDim
// columns); tiles without ping-pong only (d192, d256: the turns with a warpgroup waiting for the next Q were not
// checked). FLASHGEN_V3_O_IN_Q=0: O from registers there.
#ifndef FLASHGEN_V3_O_IN_Q
#define FLASHGEN_V3_O_IN_Q 1
#endif
constexpr bool o_in_q(const TileConfig& c, int head_dim_bucket, int value_bucket) {
  return FLASHGEN_V3_O_IN_Q != 0 && FLASHGEN_V3_TMA_STORE_O != 0 && kWarpSpecialized && !c.pingpong &&
         value_bucket == head_dim_bucket && !o_through_smem(c, head_dim_bucket, value_bucket);
}
// O leaves by TMA stores (its own stage or Q's buffer): the host makes the O tensor map (v3_api.cu).
constexpr bool o_by_tma(const TileConfig& c, int head_dim_bucket, int value_bucket) {
  return o_through_smem(c, head_dim_bucket, value_bucket) || o_in_q(c, head_dim_bucket, value_bucket);
}

// ---- the split-KV instance (kernel_traits.cuh kSplit, v3_api.cu plan_fwd) ----
// The bucket's masked tile with one consumer warpgroup (FLASHGEN_V3_SPLIT_ONE_WARPGROUP, default 1; 0 gives it the
// masked tile's two): the split instance's query block holds <= 64 rows, so with two warpgroups one of them only
// waits for each buffer and passes the ping-pong turn, and Q's tile is 128 rows where 64 do. Measured (H100, CUDA
// graphs, bench/NOTES.md session 48): one query row 1.0-2.3 us less a step (b4 2k 29.6 -> 28.6 us, pages of 16 at
// 8k 31.2 -> 29.5), four rows even.
#ifndef FLASHGEN_V3_SPLIT_ONE_WARPGROUP
#define FLASHGEN_V3_SPLIT_ONE_WARPGROUP 1
#endif
// FLASHGEN_V3_COMBINE_PDL (default 1; 0 launches the combine plainly): the combine behind the split instance is
// launched as a programmatic dependent (cudaLaunchAttributeProgrammaticStreamSerialization; the split kernel signals
// griddepcontrol.launch_dependents as each CTA starts, the combine waits in griddepcontrol.wait), so its launch
// overlaps the split kernel instead of following it. Measured (H100, CUDA graphs, tools/ab_split.sh, two A/Bs of 2
// rounds, bench/NOTES.md session 49): four packed rows at b4 2k 1.17 -> 1.13x v2's time, 8k 1.03 -> 1.02x; one row
// within +-1.5% (b4 2k a little worse in both A/Bs, b1 pages of 16 a little better).
#ifndef FLASHGEN_V3_COMBINE_PDL
#define FLASHGEN_V3_COMBINE_PDL 1
#endif
// FLASHGEN_V3_PDL (default 1; 0: plain launches): every forward instance (fwd_kernel.cuh) is launched as a
// programmatic dependent of the kernel before it on the stream (fwd_launch.cuh). Its CTAs may then start while that
// kernel finishes (at once where it signals griddepcontrol.launch_dependents, as the KV-cache append does,
// bindings/kv_append_cuda.cu), set up their barriers and tensor maps, and wait in griddepcontrol.wait before their
// first global access, so the launch's latency and the prologue overlap the kernel before. Where the work before it
// on the stream is not a kernel (a memcpy, a graph's first node), the launch is a plain one. With 0 the kernels' SASS
// is that of the tree before the option. Measured (H100, CUDA graphs, append + attention per step,
// `APPEND=1 IN_PLACE=1 bash v3_hopper/tools/ab_split.sh base= pdl=-DFLASHGEN_V3_PDL=1`, bench/NOTES.md session 51):
// 0.2-2.1 us a step less in 19 of 20 rows (the 20th, b4 32k one token, +0.3 us of 197); b1 8k one token 31.5 ->
// 30.1 us, four tokens read in place 34.9 -> 33.3 us, b4 2k four 32.4 -> 31.0.
#ifndef FLASHGEN_V3_PDL
#define FLASHGEN_V3_PDL 1
#endif
// FLASHGEN_V3_SPLIT_BALANCED (default 1; 0: split_kv_count): the split instance's count from common/split_kv.h's
// split_kv_count_balanced (the shortest chain of key blocks on the busiest SM) instead of split_kv_count's first
// count within 85% of the best fill. On 132 SMs they differ where few tiles meet many key blocks: batch 1 with 8 KV
// heads takes 14 splits at 32k and 128k (19 / 74 blocks a CTA on 112 SMs), 16 balanced (16 / 64 blocks on 128 SMs);
// 4 KV heads 29 -> 32 at 32k, 28 -> 32 at 128k; batch 2 7 -> 8 from 8k; batch 4 and caches of 2k-8k at batch 1 keep
// their counts. Measured (H100, CUDA graphs of append + attention, 3 rounds, bench/results/v3-dev/
// 2026-12-05-s52-ab-split-balanced-early-h100.*): b1 128k one token 204.3 -> 197.5 us, four tokens 207.4 -> 200.5,
// b1 32k over pages of 16 70.9 -> 69.8; every other row within +-0.4 us. `bash v3_hopper/tools/ab_split.sh base=
// old=-DFLASHGEN_V3_SPLIT_BALANCED=0` measures it again.
#ifndef FLASHGEN_V3_SPLIT_BALANCED
#define FLASHGEN_V3_SPLIT_BALANCED 1
#endif
// FLASHGEN_V3_SPLIT_UNIT_BYTES (default 196608; 0: one key block, common/split_kv.h kSplitUnitBlocks, as before
// session 57): the balanced count's cost of a unit (its prologue, partial result and share of the combine) as the key
// blocks that read this many bytes of K and V, at least one (split_unit_blocks): three 128-key blocks at d128, six
// 64-key blocks (six of d64's 128 keys, not measured; three of d256's 80). One block of any size
// undercounted small tiles: on the packed rows' 64-key tile batch 1 with 8 KV heads planned 33 splits at 128k (264
// units, two rounds on 132 SMs, a chain of 2 x (63 + 1) blocks against 16 splits' 128 + 1) and ran 1-2% slower than
// v2 where the 128-key tile's 16 splits ran 1.5% faster. A/B (H100, 2 rounds,
// bench/results/v3-dev/2026-12-06-s57-ab-split-unit-h100.txt), v3 / v2 time, one block -> 65536 bytes: four tokens
// at 128k b1 0.994 -> 0.960 (33 -> 16 splits), b2 1.034 -> 0.980, b4 1.031 -> 0.979. 65536 still planned 33 splits
// at 200k keys (cache lengths that are not powers of two); A/B 65536 -> 196608 (session 58,
// bench/results/v3-dev/2026-12-06-s58-ab-split-unit-bytes-h100.txt): one token b1 1.015 -> 0.996, b2 1.009 -> 0.991;
// four tokens b1 0.989 -> 0.970, b2 0.991 -> 0.970, b4 0.992 -> 0.972; the 128k controls the same. A fit of
// session 57's rows put a unit at 140-215 KB. At d256 (H200, ...-s58-ab-split-unit-bytes-d256-h200.txt), where one
// 80-key block is 80 KB and 128k planned 33 splits at batch 1-8: one token b1 1.108 -> 1.054, b2 1.087 -> 1.045,
// b8 1.026-1.045 -> 1.000-1.023; four tokens b1 1.064 -> 1.024-1.037, b4 1.005-1.013 -> 1.000.
#ifndef FLASHGEN_V3_SPLIT_UNIT_BYTES
#define FLASHGEN_V3_SPLIT_UNIT_BYTES 196608
#endif
// The balanced count's unit cost in key blocks of block_n keys at head_dim_bucket (16-bit K and V): the bytes' ceiling
// in blocks, at least one since the bytes are positive.
constexpr int split_unit_blocks(int block_n, int head_dim_bucket) {
  const long long block_bytes = 4LL * block_n * head_dim_bucket;  // K and V, 2 bytes an element
  return FLASHGEN_V3_SPLIT_UNIT_BYTES <= 0
             ? kSplitUnitBlocks
             : static_cast<int>((FLASHGEN_V3_SPLIT_UNIT_BYTES + block_bytes - 1) / block_bytes);
}
static_assert(split_unit_blocks(128, 128) >= 1 && split_unit_blocks(64, 256) >= 1, "a unit costs a block at least");
// FLASHGEN_V3_SPLIT_BLOCK_N / FLASHGEN_V3_SPLIT_STAGES (default 0: the masked tile's): the split tile's keys per stage
// and stages at d128, for A/Bs of the decode instance alone (tools/ab_split.sh); FLASHGEN_V3_SPLIT_D256_BLOCK_N /
// FLASHGEN_V3_SPLIT_D256_STAGES the same at d256 (HEAD_DIM=256 tools/ab_split.sh).
#ifndef FLASHGEN_V3_SPLIT_BLOCK_N
#define FLASHGEN_V3_SPLIT_BLOCK_N 0
#endif
#ifndef FLASHGEN_V3_SPLIT_STAGES
#define FLASHGEN_V3_SPLIT_STAGES 0
#endif
#ifndef FLASHGEN_V3_SPLIT_D256_BLOCK_N
#define FLASHGEN_V3_SPLIT_D256_BLOCK_N 0
#endif
#ifndef FLASHGEN_V3_SPLIT_D256_STAGES
#define FLASHGEN_V3_SPLIT_D256_STAGES 0
#endif
// FLASHGEN_V3_SPLIT_PACKED_BLOCK_N (default 64; 0: none): packed query rows (AttnParams::q_pack > 1) over a dense cache
// (packed_split_tile) run on a second d128 split instance of this many keys a stage (kernel_traits.cuh kSplit with
// kShortTile, 2 stages, 97 KB), one token and pages on the first (128 keys). Session 55's A/B of a 64-key split tile
// for every call (H100, bench/NOTES.md): b16 four tokens 1.012-1.014 -> 0.995-1.001 of v2's time and every other packed
// row 0-2.5% faster, but batch 1 one token at 128k 0.999 -> 1.018 (the same at caches 64 MB further on: the work's, not
// the addresses'). Session 56's A/B of this option (H100, 2 rounds, v2 in each row's process,
// bench/results/v3-dev/2026-12-06-s56-ab-split-packed-h100.*): b16 four tokens at 8k / 32k / 128k 1.004 / 1.011 / 1.005
// -> 0.980 / 0.994 / 0.995 of v2's time, b1 four tokens at 8k 0.92 -> 0.84, b4 four tokens 0.93 / 0.98 -> 0.91 / 0.96,
// b1 128k four 0.987 -> 0.995; one token unchanged (b1 128k 1.000 in both).
#ifndef FLASHGEN_V3_SPLIT_PACKED_BLOCK_N
#define FLASHGEN_V3_SPLIT_PACKED_BLOCK_N 64
#endif
// FLASHGEN_V3_SPLIT_PACKED_PAGED: which packed calls over a paged cache take that tile too. 0: none (dense caches
// only); 1: all; 2: those whose packed tile is one TMA box (paged_tile_box_rows: pages a multiple of its keys, or one
// page per sequence), as a dense cache's is. Session 56's A/B of 1 (H100, 2 rounds,
// bench/results/v3-dev/2026-12-06-s56-ab-split-packed-paged-h100.txt), v3 / v2 time: b1 four tokens over pages of 16 at
// 8k 0.95 -> 0.86 and b16 pages of 256 at 32k / 128k 1.004 / 1.001 -> 0.992 / 0.997, but b1 128k pages of 16 / 256
// 0.99 -> 1.01 and b16 pages of 16 at 32k / 128k 1.01 -> 1.02: mixed, so not the default; the b16 gains were on
// one-box tiles (pages of 256), the b16 losses on four-box tiles (pages of 16). Session 57's A/B of 2 (H100, 2 rounds,
// with split_unit_blocks below; bench/results/v3-dev/2026-12-06-s57-ab-split-unit-h100.txt): b1 four tokens over
// pages of 256 at 8k / 128k 0.96 / 0.99 -> 0.85 / 0.97 of v2's time, b16 at 32k 1.005 -> 0.999, 128k 1.002 -> 1.003.
#ifndef FLASHGEN_V3_SPLIT_PACKED_PAGED
#define FLASHGEN_V3_SPLIT_PACKED_PAGED 2
#endif
constexpr bool is_d128_bucket(int head_dim_bucket) { return head_dim_bucket > 64 && head_dim_bucket <= 128; }
constexpr bool has_packed_split_tile(int head_dim_bucket) {
  return FLASHGEN_V3_SPLIT_PACKED_BLOCK_N > 0 && is_d128_bucket(head_dim_bucket);
}
// Whether a split call takes the packed rows' tile: q_pack > 1, and a dense cache unless
// FLASHGEN_V3_SPLIT_PACKED_PAGED (page_block_size and seqlen_k: the paged cache's, read only when paged).
constexpr bool packed_split_tile(int head_dim_bucket, int q_pack, bool paged, int page_block_size, int seqlen_k) {
  if (q_pack <= 1 || !has_packed_split_tile(head_dim_bucket)) return false;
  if (!paged || FLASHGEN_V3_SPLIT_PACKED_PAGED == 1) return true;
  return FLASHGEN_V3_SPLIT_PACKED_PAGED == 2 &&
         paged_tile_box_rows(page_block_size, seqlen_k, FLASHGEN_V3_SPLIT_PACKED_BLOCK_N) ==
             FLASHGEN_V3_SPLIT_PACKED_BLOCK_N;
}
// packed: the tile of packed query rows (has_packed_split_tile), else the split tile of every call.
constexpr TileConfig split_tile_config(int head_dim, bool packed = false) {
  TileConfig c = tile_config(head_dim, true);
  if (FLASHGEN_V3_SPLIT_BLOCK_N > 0 && is_d128_bucket(head_dim)) c.block_n = FLASHGEN_V3_SPLIT_BLOCK_N;
  if (FLASHGEN_V3_SPLIT_STAGES > 0 && is_d128_bucket(head_dim)) c.stages = FLASHGEN_V3_SPLIT_STAGES;
  if (FLASHGEN_V3_SPLIT_D256_BLOCK_N > 0 && head_dim > 192) c.block_n = FLASHGEN_V3_SPLIT_D256_BLOCK_N;
  if (FLASHGEN_V3_SPLIT_D256_STAGES > 0 && head_dim > 192) c.stages = FLASHGEN_V3_SPLIT_D256_STAGES;
  if (packed && has_packed_split_tile(head_dim)) c.block_n = FLASHGEN_V3_SPLIT_PACKED_BLOCK_N;
  return FLASHGEN_V3_SPLIT_ONE_WARPGROUP != 0 ? TileConfig{1, c.block_n, c.stages, false} : c;
}
static_assert(budget_fits(split_tile_config(128, true)) &&
                  smem_bytes(split_tile_config(128, true), 128) <= kMaxSmemPerBlock,
              "the packed rows' split tile exceeds the shared memory of one CTA or its register budget");
static_assert(budget_fits(split_tile_config(64)) && budget_fits(split_tile_config(128)) &&
                  budget_fits(split_tile_config(256)) &&
                  smem_bytes(split_tile_config(256), 256) <= kMaxSmemPerBlock,
              "the split tile exceeds the shared memory of one CTA or its register budget");

// ---- V with its own head dim (FA3's hdim_v; MLA's prefill: q / k 192, v 128) ----
// The forward instances whose V bucket differs from Q's and K's (v3_hopper/CMakeLists.txt FLASHGEN_V3_VALUE_HEAD_DIMS
// lists them as "<q/k bucket>:<v bucket>"): O += P V and O's registers, stage and store at V's width, so the P V GEMM
// does (192 + 128) / (192 + 192) = 0.83 of the padded call's FLOPs and V is not copied. The tile: d192's 128-row
// query block with 128 keys, two stages (Q 48 + K 96 + V 64 KB = 208 KB: no room for O's 32 KB stage; 112 keys,
// d192's plain tile, would leave it room), ping-pong as d128's (O is d128's 64 registers a thread). FA3's sm90 table
// takes 128 x 128 for hdim 192 / hdim_v 128 as well. FLASHGEN_V3_VALUE_BLOCK_N / _PINGPONG: the A/B's other tiles.
#ifndef FLASHGEN_V3_VALUE_BLOCK_N
#define FLASHGEN_V3_VALUE_BLOCK_N 128
#endif
#ifndef FLASHGEN_V3_VALUE_PINGPONG
#define FLASHGEN_V3_VALUE_PINGPONG 1
#endif
constexpr TileConfig value_tile_config(int head_dim_bucket, int value_bucket, bool masked) {
  return value_bucket == head_dim_bucket ? tile_config(head_dim_bucket, masked)
                                         : TileConfig{2, FLASHGEN_V3_VALUE_BLOCK_N, 2, FLASHGEN_V3_VALUE_PINGPONG != 0};
}
constexpr bool value_config_ok(int head_dim_bucket, int value_bucket, bool masked) {
  return smem_bytes(value_tile_config(head_dim_bucket, value_bucket, masked), head_dim_bucket, value_bucket) <=
             kMaxSmemPerBlock &&
         budget_fits(value_tile_config(head_dim_bucket, value_bucket, masked));
}
static_assert(value_config_ok(192, 128, false) && value_config_ok(192, 128, true),
              "the 192 / 128 tile exceeds the shared memory of one CTA or its register budget");

constexpr bool config_ok(int head_dim_bucket, bool masked) {
  return smem_bytes(tile_config(head_dim_bucket, masked), head_dim_bucket) <= kMaxSmemPerBlock &&
         budget_fits(tile_config(head_dim_bucket, masked));
}
static_assert(config_ok(64, false) && config_ok(64, true) && config_ok(128, false) && config_ok(128, true) &&
                  config_ok(192, false) && config_ok(192, true) && config_ok(256, false) && config_ok(256, true),
              "a v3 tile exceeds the shared memory of one CTA or its register budget");
static_assert(smem_bytes(short_tile_config(192), 192) <= kMaxSmemPerBlock && budget_fits(short_tile_config(192)) &&
                  smem_bytes(short_tile_config(256), 256) <= kMaxSmemPerBlock && budget_fits(short_tile_config(256)),
              "a short tile exceeds the shared memory of one CTA or its register budget");

// ---- persistent tile order (kernel_traits.cuh TileScheduler walks it in rounds of gridDim.x CTAs) ----
// A tile is (query block m, head_batch = batch * num_heads + head). Without a causal-like mask the query blocks run
// fastest, so the CTAs of one round share a head's K and V in L2. With one (work grows with m) the tiles go
// heaviest first (FA3's LPT order), heads fastest. When the heads' K/V do not fit in L2 that order streams them from
// DRAM: the CTAs of one head drift apart, and each re-reads K/V another evicted. At 2k causal d128 (128 heads of
// 1 MB) the L2 hit rate was 33% and DRAM ran at 69% (bench/NOTES.md session 14); at 8k causal d128 (32 heads of
// 4 MB) 66% and 28%, and under sustained load, where the card holds ~600 W, that DRAM traffic cost the SM clock:
// 1.51 GHz against cuDNN's 1.71 on the same shape (session 25). Then the heads go in groups of at most
// kTileGroupBytes of K/V, and a round holds several query blocks of the same few heads (8k causal d128: L2 hits 91%,
// DRAM 7%, 1.67 GHz, +6%). Groups alternate heaviest-first and lightest-first, so the round-robin still pairs heavy
// with light tiles; how evenly depends on where the group boundaries fall in the rounds (a host simulation of the
// makespan over group sizes is jagged: at 8k causal d128 1.07x the mean with groups of 6 heads, 1.02x with 5,
// 1.001x with 12), so the host picks the size (choose_tile_group) and the kernel takes it as a launch parameter.
constexpr int64_t kTileGroupBytes = 24ll << 20;  // K + V bytes one group of heads may touch: half an H100's L2
// FLASHGEN_V3_TRACE=1 (a diagnostic build; v3_hopper/tools/trace_fwd.sh builds one): the forward's producer and
// consumer warpgroups stamp clock64() at fixed points of each tile (kernel_traits.cuh TraceEvent) into the buffer
// whose address the environment's FLASHGEN_V3_TRACE_PTR gives at each launch (v3_api.cu), slots (CTA, role, round %
// kTraceRounds, event). 0: no trace code at all.
#ifndef FLASHGEN_V3_TRACE
#define FLASHGEN_V3_TRACE 0
#endif
constexpr int kTraceRoles = 4, kTraceRounds = 64, kTraceEvents = 32;
struct TileOrder {
  int num_m_blocks, heads_batches;
  int group;         // head_batches per group; heads_batches when ungrouped
  bool heavy_first;  // causal-like: heaviest query block first
  // The divisions of coord() by launch constants, made once with the order (common/row_divider.h): by num_m_blocks,
  // by a group's tiles (group x num_m_blocks), by the group size and by the last group's (it may be short).
  RowDivider by_m_blocks, by_group_tiles, by_group, by_last_group;
  RowDivider by_heads;  // by num_heads, for TileScheduler (set by the launch: launch_tile_order)
#if FLASHGEN_V3_TRACE
  unsigned long long* trace;  // the launch's trace buffer or nullptr (value-initialized by make_tile_order)
#endif
  FH_HD int num_tiles() const { return num_m_blocks * heads_batches; }
  // (query block, head_batch) of `tile` < num_tiles().
  FH_HD void coord(int tile, int* m_block, int* head_batch) const {
    if (!heavy_first) {
      *head_batch = by_m_blocks.div(tile);
      *m_block = tile - *head_batch * num_m_blocks;
      return;
    }
    const int g = by_group_tiles.div(tile), r = tile - g * group * num_m_blocks;
    const bool last = heads_batches - g * group < group;  // the last group may be short
    const int size = last ? heads_batches - g * group : group;
    const int k = (last ? by_last_group : by_group).div(r);
    *m_block = (g & 1) ? k : num_m_blocks - 1 - k;
    *head_batch = g * group + r - k * size;
  }
};
// group: heads per group from choose_tile_group (ignored without a causal-like mask; clamped to [1, heads_batches]).
FH_HD TileOrder make_tile_order(int num_m_blocks, int heads_batches, bool heavy_first, int group) {
  if (!heavy_first || group > heads_batches) group = heads_batches;
  if (group < 1) group = 1;
  const int last = heads_batches % group;
  return {num_m_blocks,
          heads_batches,
          group,
          heavy_first,
          RowDivider::make(num_m_blocks),
          RowDivider::make(group * num_m_blocks),
          RowDivider::make(group),
          RowDivider::make(last > 0 ? last : group),
          RowDivider{}};
}

// The CTA of round r that takes the round's c-th tile (TileScheduler::tile_of_round): odd rounds of a heavy-first
// order run backwards (snake), so a CTA that took a heavy tile takes a light one next.
FH_HD int tile_order_cta(const TileOrder& o, int round, int c, int grid) {
  return o.heavy_first && (round & 1) ? grid - 1 - c : c;
}

// Simulated max / mean of the CTAs' causal work under order o on `grid` CTAs: query block m costs m + 1 key tiles
// plus kTileOverheadKeyTiles (Q load, prologue, epilogue), the model test_v3_tiles.cpp checks the orders with.
constexpr double kTileOverheadKeyTiles = 0.3;
constexpr int kMaxSimulatedTiles = 1 << 18;  // beyond this choose_tile_group does not simulate (host time)
constexpr int kMaxSimulatedGrid = 1024;
inline double tile_order_makespan(const TileOrder& o, int grid) {
  double load[kMaxSimulatedGrid] = {};
  double total = 0;
  for (int t = 0; t < o.num_tiles(); ++t) {
    int m = 0, hb = 0;
    o.coord(t, &m, &hb);
    const double w = m + 1 + kTileOverheadKeyTiles;
    load[tile_order_cta(o, t / grid, t % grid, grid)] += w;
    total += w;
  }
  double worst = 0;
  for (int c = 0; c < grid; ++c) worst = load[c] > worst ? load[c] : worst;
  return total > 0 ? worst / (total / grid) : 1.0;
}

// Heads per group for a causal-like launch (heads_batches = ungrouped), chosen on the host. kv_bytes: K + V bytes
// of one head_batch (GQA's K/V divided among its query heads); grid: CTAs. Grouped when the heads' K/V exceed
// kTileGroupBytes in all or the heads outnumber half the grid (each round would hold every head once); the size is
// the best-balanced one (tile_order_makespan) of those whose K/V fit kTileGroupBytes and at most half the grid (a
// round then holds two query blocks of each head); ties go to the smaller size, whose rounds share fewer heads' K/V:
// at 512 causal d128 (512 head-batches of 4 query blocks) sizes 2, 4, 8 and 57 balance alike (1.031x the mean),
// and 57, the size ties went to before, read 221 MB from DRAM where the compulsory Q + K + V is 201 MB. Groups of 2
// ran that launch 5% faster on an H100 (d256 too), and this rule +2% (d256 +3.5%) on an H200 (bench/NOTES.md
// session 75). A launch grouped only for its bytes stays ungrouped when no such size comes within
// kTileGroupMaxImbalance of the ungrouped order's balance: d256 8k causal (16 heads of 8 MB) had 1.22x the mean at
// its best size of 3, and ran 5% slower grouped than not (session 25).
constexpr double kTileGroupMaxImbalance = 0.05;
inline int choose_tile_group(int num_m_blocks, int heads_batches, bool heavy_first, int64_t kv_bytes, int grid) {
  if (!heavy_first || heads_batches <= 1 || grid < 1 || grid > kMaxSimulatedGrid) return heads_batches;
  const bool many_heads = 2 * heads_batches > grid;  // grouped whatever the balance (the 2k causal case above)
  if (!many_heads && static_cast<int64_t>(heads_batches) * kv_bytes <= kTileGroupBytes) {
    return heads_batches;  // every head's K/V fits, and a round holds several query blocks of each head
  }
  int64_t cap = kv_bytes > 0 ? kTileGroupBytes / kv_bytes : heads_batches;
  if (cap > grid / 2) cap = grid / 2;
  if (cap > heads_batches) cap = heads_batches;
  if (cap < 1) cap = 1;
  if (static_cast<int64_t>(num_m_blocks) * heads_batches > kMaxSimulatedTiles) return static_cast<int>(cap);
  const double ungrouped = tile_order_makespan(make_tile_order(num_m_blocks, heads_batches, true, heads_batches), grid);
  int best = static_cast<int>(cap);
  double best_span = 1e30;
  for (int g = static_cast<int>(cap); g >= 1; --g) {
    const double span = tile_order_makespan(make_tile_order(num_m_blocks, heads_batches, true, g), grid);
    if (span <= best_span + 1e-9) {
      best_span = span;
      best = g;
    }
  }
  return many_heads || best_span <= ungrouped + kTileGroupMaxImbalance ? best : heads_batches;
}

// ---- backward (bwd_traits.cuh): a CTA owns block_n keys of one KV head and walks the query blocks of block_m rows
// that see them, streaming Q, dO, LSE and D through a stages-deep ring; two consumer warpgroups.
//   d128: 128 keys, 64 per consumer warpgroup (the wgmma M of S^T = K Q^T), each with its dK and dV rows in
//              registers (2 x head_dim / 2 fp32 per thread).
//   d192, d256 (split): dK + dV of 64 keys alone would take 192-256 registers per thread, so the CTA owns 64 keys
//              and the warpgroups split the work: each computes S^T and dP^T of the 64 keys against its half of the
//              block's queries (64 x 32, N = 32), P^T and dS^T meet in shared memory, then warpgroup 0 accumulates
//              dV += P^T dO and warpgroup 1 dK += dS^T Q (head_dim / 2 registers each), and dQ = dS K is split by
//              64-column parts, added into dq_accum from registers (no staging buffer: it would not fit at d256).
//   d64 (dq_rows): 128 queries per step, FA3's d64 tile (hopper/flash_bwd_launch_template.h: 128 x 128, S^T swapped
//              as here, dQ split by query rows, AtomLayoutMdQ 2): each consumer warpgroup computes S^T and dP^T of its
//              64 keys against all 128 queries (N = 128), dV and dK from registers as above, and dQ = dS K is split
//              by query rows (warpgroup w: rows 64w.. over all 128 keys, both warpgroups' dS^T), so each dQ element
//              is added into dq_accum once per step instead of once per warpgroup. Twice the GEMM work per step of
//              the 64-query tile for the same barriers and dQ hand-offs. To stay within 240 registers
//              (bwd_consumer.cuh) the block's LSE rows are spread over the warp and taken by shuffles (FA3's
//              ShuffleStats), and dS^T is computed from P^T's 16-bit fragments. bwd_dq_rows_tile says which launches
//              take it.
struct BwdTileConfig {
  int block_m, block_n, stages;
  bool split;
  bool dq_rows = false;  // d64: 128 queries per step, dQ split by query rows (above)
  // split: dQ's 64-column parts staged in shared memory for the dQ writer warp's bulk reduce-adds (as without split)
  // instead of REDs from registers (d192 and the value tiles; d256 has no room)
  bool dq_staged = false;
};
constexpr int kBwdConsumers = 2;
constexpr int kBwdMaxHeadDim = 256;
constexpr int kBwdSplitMinHeadDim = 160;  // buckets above 128 take the split layout
// Stages: the 64-query d64 step (5 GEMMs of 64 x 128 x 64) takes ~1.2 us at 600 TFLOP/s over 132 SMs, shorter than a
// Q / dO load's round trip, so 2 stages left it waiting; it runs 4 (three steps of lookahead). The dq_rows step is
// twice as long, and 2 stages of 128 rows (~2.4 us of lookahead) are what fits beside the two 32 KB dS^T buffers:
// Q, dO 64 KB, K, V 32 KB, dS^T 64 KB, dQ staging 32 KB, 194 KB with the rows and barriers (a third stage: 227+).
// d128's step is twice as long and 3 stages would not fit beside its tiles (224 KB of 227). d256 (split): 2 stages
// of 64 x 256 Q and dO, K and V, and four 8 KB P^T / dS^T buffers take 226 KB.
constexpr int kBwdRowsMaxHeadDim = 64;  // buckets up to 64 have the dq_rows tile beside the 64-query one
// dq_rows: the launch's choice (bwd_dq_rows_tile); only buckets up to kBwdRowsMaxHeadDim have that tile.
// Split buckets whose smem has room for all of a query block's dQ parts (d192: 48 KB more, 226 KB of 227; d256 has
// none left) stage them for the dQ writer warp's bulk reduce-adds (dq_staged) instead of REDs from registers: d192
// backward +11-14% at 2k-8k on an H100 (bench/NOTES.md session 46). FLASHGEN_V3_BWD_SPLIT_DQ_STAGED=0: REDs (A/Bs).
#ifndef FLASHGEN_V3_BWD_SPLIT_DQ_STAGED
#define FLASHGEN_V3_BWD_SPLIT_DQ_STAGED 1
#endif
constexpr bool kBwdSplitDqStaged = FLASHGEN_V3_BWD_SPLIT_DQ_STAGED != 0;
constexpr int kBwdSplitDqStagedMaxHeadDim = 192;
constexpr BwdTileConfig bwd_tile_config(int head_dim, bool dq_rows = false) {
  const bool staged = kBwdSplitDqStaged && head_dim <= kBwdSplitDqStagedMaxHeadDim;
  return head_dim >= kBwdSplitMinHeadDim             ? BwdTileConfig{64, 64, 2, true, false, staged}
         : head_dim <= kBwdRowsMaxHeadDim && dq_rows ? BwdTileConfig{128, 128, 2, false, true}
                                                     : BwdTileConfig{64, 128, head_dim <= 64 ? 4 : 2, false};
}
// Which d64 tile a launch takes (session 32, A/B against the 64-query tile, 2-3 rounds, bench/NOTES.md): dq_rows gained
// 6-12% without a mask at 512-8k and 0-5% causal from 2k up, and lost 3-5% causal at 512 / 1k (its 128-query blocks
// waste more of the diagonal). With softcap or ALiBi its step needs S^T's fp32 values beside everything else (the
// plain step computes dS^T from P^T's 16-bit fragments) and ptxas serialized its wgmmas (C7512): 17-21% slower, so
// those launches keep the 64-query tile. masked: causal or a window; max_seqlen_k: seqlen_k (varlen: the longest).
constexpr int kBwdRowsMinMaskedKeys = 2048;
constexpr bool bwd_dq_rows_tile(int head_dim_bucket, bool mods, bool masked, int max_seqlen_k) {
  return head_dim_bucket <= kBwdRowsMaxHeadDim && !mods && (!masked || max_seqlen_k >= kBwdRowsMinMaskedKeys);
}
// The largest block_m of any bucket: the row workspaces and dq_accum are sized for it (v3_api.cu bwd_rows), so every
// bucket's blocks are whole inside them.
constexpr int kBwdMaxBlockM = 128;
constexpr int bwd_num_threads() { return (1 + kBwdConsumers) * kWarpgroupThreads; }
constexpr RegisterBudget bwd_register_budget() { return {24, 240}; }
// mbarriers: K/V full, then per stage full and empty (Q, dO, LSE, D of one query block).
constexpr int bwd_barrier_count(int stages) { return 1 + 2 * stages; }
// dQ = dS K of one step is split between the consumer warpgroups in (block_m x kBwdDqCols) fp32 parts; without
// split, each is staged in shared memory for one bulk reduce-add into dq_accum.
constexpr int kBwdDqCols = 64;
// (block_n x block_m) 16-bit buffers: two dS^T (double-buffered over steps); split adds two P^T.
constexpr int bwd_ds_buffers(const BwdTileConfig& c) { return c.split ? 4 : 2; }
// dq_rows: a consumer warpgroup's dQ part is (block_m / 2 x kBwdDqCols) fp32, else (block_m x kBwdDqCols); split
// with dq_staged: every part of a query block (head_dim / kBwdDqCols), each in its own slot.
constexpr int bwd_dq_staging_bytes(const BwdTileConfig& c, int head_dim_bucket) {
  return c.split ? (c.dq_staged ? head_dim_bucket / kBwdDqCols * c.block_m * kBwdDqCols * 4 : 0)
                 : c.dq_rows ? c.block_m * kBwdDqCols * 4 : kBwdConsumers * c.block_m * kBwdDqCols * 4;
}
// Q and dO per stage, K, V, the dS^T (and P^T) buffers, the dQ staging parts, LSE and D rows per stage, barriers,
// align slack. value_bucket: V's and dO's head-dim bucket where V has its own (bwd_value_tile_ok), else q / k's.
constexpr int bwd_smem_bytes(const BwdTileConfig& c, int head_dim_bucket, int value_bucket = 0) {
  const int dv = value_bucket > 0 ? value_bucket : head_dim_bucket;
  return (c.stages * c.block_m + c.block_n) * (head_dim_bucket + dv) * kElementBytes +
         bwd_ds_buffers(c) * c.block_n * c.block_m * kElementBytes + bwd_dq_staging_bytes(c, head_dim_bucket) +
         2 * c.stages * c.block_m * 4 +
         bwd_barrier_count(c.stages) * kBarrierBytes + kSwizzleAtomBytes;
}
// ---- the backward with V's own head dim (FA3's hdim_v; MLA's q / k 192 with v 128) ----
// The split layout only (q / k buckets from kBwdSplitMinHeadDim): warpgroup 0 holds dV, so with V narrower its
// registers and its dV GEMM shrink to V's bucket (64 x 128 fp32: 64 registers, 96 at 192), dP^T = V dO^T runs over V's
// columns, and Q, K keep q / k's. The work per step balances: at 192 / 128 warpgroup 0 does dV (128 columns) and dQ
// parts 0, 2 (128), warpgroup 1 dK (192) and dQ part 1 (64). Buckets of V: 64, 128, 192, below q / k's (a wider V
// would put more than d256's registers into dV).
// Stages: d192's 2; V's narrower tiles leave room for a third (192 / 128: 157 KB with 2, 197 with 3), measured even
// (bench/NOTES.md session 45). dQ: its three parts staged for the dQ writer warp's bulk reduce-adds (+48 KB: 205 KB
// with 2 stages), as d192's; FLASHGEN_V3_BWD_VALUE_DQ_STAGED=0: REDs from registers. Session 45's ncu: with REDs this
// kernel was bound by L2 (76%) with 8.1 GB of dQ REDs at 8k, where cuDNN's kernel of the same 64-key blocks (the same
// dQ bytes) adds them in bulk at 71% over a shorter time; staged, MLA's fwd + bwd ran 6-9% faster at 4k-8k (session
// 46, H100). A/Bs: v3_hopper/tools/ab_value.sh.
#ifndef FLASHGEN_V3_BWD_VALUE_STAGES
#define FLASHGEN_V3_BWD_VALUE_STAGES 2
#endif
#ifndef FLASHGEN_V3_BWD_VALUE_DQ_STAGED
#define FLASHGEN_V3_BWD_VALUE_DQ_STAGED 1
#endif
constexpr BwdTileConfig bwd_value_tile_config(int head_dim_bucket) {
  return BwdTileConfig{bwd_tile_config(head_dim_bucket).block_m, bwd_tile_config(head_dim_bucket).block_n,
                       FLASHGEN_V3_BWD_VALUE_STAGES, true, false, FLASHGEN_V3_BWD_VALUE_DQ_STAGED != 0};
}
constexpr bool bwd_value_tile_ok(int head_dim_bucket, int value_bucket) {
  return head_dim_bucket >= kBwdSplitMinHeadDim && head_dim_bucket <= kBwdMaxHeadDim && value_bucket > 0 &&
         value_bucket % kChunkCols == 0 && value_bucket < head_dim_bucket &&
         bwd_smem_bytes(bwd_value_tile_config(head_dim_bucket), head_dim_bucket, value_bucket) <= kMaxSmemPerBlock;
}
static_assert(bwd_value_tile_ok(192, 128) && bwd_value_tile_ok(192, 64) && !bwd_value_tile_ok(128, 64),
              "the backward's value tiles: split buckets, V narrower");

// The backward's tail split. FLASHGEN_V3_BWD_TAIL_SPLIT is the build's default, which the environment variable of the
// same name ("0" or "1") overrides per call (v3_api.cu bwd_tail_for); 0 (every CTA takes its whole key block): on the
// H100 it measured even (tail / base 0.97-1.01 at d128 4k-16k full over 8 alternating rounds, bench/NOTES.md session
// 68), since the card runs the backward power-capped at ~1,550 MHz and the SMs busy under a part-empty last round clock
// up, so that round costs less than its cycles. Without a mask every CTA of the backward has the same work, and the
// FlashAttention grid has 2048 of them at every point (16k tokens x 16 heads / 128 keys) against 132 SMs: 15 full
// rounds and a last one of 68 CTAs, under which 64 SMs idle for a whole CTA (~3% of the launch's cycles). The last
// `units` CTAs of the grid are cut into `pieces` CTAs each, every piece a contiguous share of the unit's query blocks
// (the same share of each query head of its group); a piece stores its fp32 dK and dV in its own slot of the grad_parts
// workspace (fragment order) and bwd_tail_reduce_kernel adds the slots of a unit in piece order and writes dK and dV:
// no atomics, so dK and dV stay bitwise reproducible. Counted in query-block steps: a CTA costs its steps plus
// kBwdPieceFixedSteps (its K / V load and pipeline fill, the parts' stores); the tail's rounds are ceil(units x pieces
// / slots). The pieces taken are those of least cost, which must save at least kBwdTailMinGain of a whole CTA's, each
// of at least kBwdMinPieceSteps steps.
#ifndef FLASHGEN_V3_BWD_TAIL_SPLIT
#define FLASHGEN_V3_BWD_TAIL_SPLIT 0
#endif
constexpr int kBwdMaxPieces = 8;
constexpr int kBwdPieceFixedSteps = 6;
constexpr int kBwdMinPieceSteps = 4;
constexpr double kBwdTailMinGain = 0.15;
struct BwdTail {
  int first = 0;   // grid index of the first split unit (the units are [first, first + units))
  int units = 0;   // key-block CTAs split (0: none)
  int pieces = 1;  // CTAs per split unit (1: none)
};
// ctas: the grid's CTAs (key blocks x KV heads x batch), each of `blocks` query blocks for each of `group` query heads
// (a step a block and head; a piece takes a share of the blocks for every head); slots: CTAs the card runs at once (the
// SMs: one backward CTA each).
constexpr BwdTail bwd_tail_plan(int64_t ctas, int64_t blocks, int64_t group, int64_t slots) {
  BwdTail none;
  const int64_t steps = blocks * group;
  if (ctas < 1 || slots < 1 || group < 1 || blocks < 2) return none;
  const int64_t units = ctas % slots;  // the last round's CTAs
  if (units == 0) return none;
  const double whole = static_cast<double>(steps + kBwdPieceFixedSteps);
  double best = whole;
  int best_pieces = 1;
  for (int pieces = 2; pieces <= kBwdMaxPieces && pieces <= blocks && pieces * kBwdMinPieceSteps <= steps; ++pieces) {
    const int64_t rounds = (units * pieces + slots - 1) / slots;
    const int64_t piece_steps = (blocks + pieces - 1) / pieces * group;  // the longest piece
    const double cost = static_cast<double>(rounds * (piece_steps + kBwdPieceFixedSteps));
    if (cost < best) {
      best = cost;
      best_pieces = pieces;
    }
  }
  if (best_pieces == 1 || whole - best < kBwdTailMinGain * whole) return none;
  return BwdTail{static_cast<int>(ctas - units), static_cast<int>(units), best_pieces};
}
// CTA `cta` of the backward's grid under `tail`: the key-block unit it works on (the grid index the unsplit launch
// gave it) and its piece, -1 for a whole unit. The pieces come piece-major after the unsplit CTAs.
struct BwdTailCta {
  int unit, piece;
};
constexpr BwdTailCta bwd_tail_cta(int cta, const BwdTail& tail) {
  if (tail.pieces <= 1 || cta < tail.first) return BwdTailCta{cta, -1};
  const int r = cta - tail.first, piece = r / tail.units;
  return BwdTailCta{tail.first + (r - piece * tail.units), piece};
}
// Query blocks [begin, end) of piece `piece` of `pieces` over a unit's [b, e): contiguous, in order, covering it.
constexpr int bwd_piece_begin(int b, int e, int piece, int pieces) {
  return b + static_cast<int>(static_cast<int64_t>(e - b) * piece / pieces);
}
// One piece's slot of grad_parts: dK then dV of both consumer warpgroups, (64 keys x the bucket) floats each.
constexpr int64_t bwd_grad_part_floats(int head_dim_bucket) {
  return 2 * static_cast<int64_t>(kBwdConsumers) * kWarpgroupRows * head_dim_bucket;
}
static_assert(bwd_tail_plan(2048, 128, 1, 132).units == 68 && bwd_tail_plan(2048, 128, 1, 132).pieces > 1 &&
                  bwd_tail_plan(2048 + 64, 128, 1, 132).pieces == 1 && bwd_tail_plan(2048, 32, 1, 132).pieces == 1,
              "the tail split: the FlashAttention grid's last round is cut at 8k; a grid of whole rounds and CTAs "
              "of 32 steps (2k) are not");

static_assert(bwd_tile_config(64, true).block_m == kBwdMaxBlockM && kBwdMaxBlockM % bwd_tile_config(64).block_m == 0 &&
                  kBwdMaxBlockM % bwd_tile_config(128).block_m == 0 &&
                  kBwdMaxBlockM % bwd_tile_config(256).block_m == 0,
              "kBwdMaxBlockM: the largest block_m, a multiple of every tile's");
static_assert(bwd_smem_bytes(bwd_tile_config(128), 128) <= kMaxSmemPerBlock &&
                  bwd_smem_bytes(bwd_tile_config(64), 64) <= kMaxSmemPerBlock &&
                  bwd_smem_bytes(bwd_tile_config(64, true), 64) <= kMaxSmemPerBlock &&
                  bwd_smem_bytes(bwd_tile_config(192), 192) <= kMaxSmemPerBlock &&
                  bwd_smem_bytes(bwd_tile_config(256), 256) <= kMaxSmemPerBlock,
              "v3 backward tile exceeds smem");
static_assert(bwd_smem_bytes(BwdTileConfig{64, 64, 2, true, false, true}, kBwdSplitDqStagedMaxHeadDim) <=
                  kMaxSmemPerBlock,
              "kBwdSplitDqStagedMaxHeadDim: its staged dQ parts fit");

}  // namespace v3
}  // namespace flashgen
