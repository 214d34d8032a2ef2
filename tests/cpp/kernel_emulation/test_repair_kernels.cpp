// The dQ-row repair's kernels emulated on the CPU, case by case: element
// types, head_dim widths, layouts, biases, causal masks, GQA, grids with runs
// across heads and walk rounds, narrow and wide tiles, clusters with split
// tiles. Each case runs twice: with cp.async data landing at its wait (shows
// a missing wait) and landing at once with warps drifting apart (shows a
// stage refilled before every warp is done with it), and on the wgmma path
// as well where head_dim allows. What each run checks: repair_case.h. The
// index math alone: test_repair_layout.cpp; the row walk alone:
// test_repair_row_walk.cpp. No GPU, no libtorch needed.

#include "simt_emu.h"  // first: it stands in for the CUDA features

#include <catch2/catch.hpp>

#include <vector>

#include "cuda/repair/layout.cuh"
#include "cuda/repair/scan.cuh"
#include "cuda/repair/run.cuh"
#include "emu_support.h"
#include "repair_case.h"

using namespace openwam::repair;
using namespace emu_test;

TEST_CASE("repair kernels emulated on the CPU", "[repair][emulated]") {
  std::vector<Case<Bf16>> bf;
  std::vector<Case<Fp16>> fp;
  {
    Case<Bf16> c;
    c.name = "bf16 d64 all rows 70x130";
    bf.push_back(c);
    c.name = "bf16 d64 share 0.3 causal bias full masked rows";
    c.share = 0.3, c.causal = true, c.bias = Case<Bf16>::kFull, c.masked_rows = 3;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d64 share 0.5 70x300 (idle warps, 5 key blocks)";
    c.share = 0.5, c.s_kv = 300;
    bf.push_back(c);
    c.name = "bf16 d64 share 0.5 70x300, 2 stages";
    c.stages = 2;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d128 one per head 40x300, 3 stages";
    c.D = 128, c.s_q = 40, c.s_kv = 300, c.share = -1;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d40 one per head keypad bias bshd";
    c.D = 40, c.share = -1, c.bias = Case<Bf16>::kKeyPad, c.layout = Layout::kBshd;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d128 gqa s_kv 64 share 0.5 row bias";
    c.D = 128, c.H = 4, c.Hkv = 2, c.s_q = 40, c.s_kv = 64, c.share = 0.5;
    c.bias = Case<Bf16>::kRows, c.masked_rows = 2, c.nan_lse_row = true;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d72 padded rows s_kv 77 full bias";
    c.D = 72, c.s_q = 33, c.s_kv = 77, c.share = 1.0, c.layout = Layout::kPadded;
    c.bias = Case<Bf16>::kFull;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d256 all rows 20x70 causal";
    c.D = 256, c.s_q = 20, c.s_kv = 70, c.causal = true, c.H = 1, c.Hkv = 1;
    bf.push_back(c);
    c.name = "bf16 d256 all rows 20x70";
    c.causal = false;
    bf.push_back(c);
    c.name = "bf16 d128 all rows 20x70 causal";
    c.D = 128, c.causal = true;
    bf.push_back(c);
    // Key blocks wholly below a tile's first row need no mask (the unmasked
    // scores_to_probs). Rows from 62 on: the tiles start at rows 62, 126 and
    // 190; the first two one key short of a key block's end (an off-by-one
    // in the test unmasks the diagonal key, and key 63 holds most of the
    // weight of the rows that see it). s_kv 190 and 250: the last key block
    // ends 2 and 6 keys early, where some threads of the loader (8 and 16
    // rows apart at head_dim 128 and 64) still have every row but the last.
    c = Case<Bf16>();
    c.name = "bf16 d128 rows 62.. of 200x190 causal full bias: unmasked blocks, then masked";
    c.D = 128, c.s_q = 200, c.s_kv = 190, c.share = 1.0, c.causal = true, c.H = 1, c.Hkv = 1;
    c.first_affected = 62, c.hot_key = 63;
    c.bias = Case<Bf16>::kFull;
    bf.push_back(c);
    c.name = "bf16 d64 one row per head 200x250 causal: narrow, unmasked blocks below the row";
    c.D = 64, c.s_kv = 250, c.share = -1, c.bias = Case<Bf16>::kNoBias, c.H = 4, c.Hkv = 4;
    c.first_affected = 0, c.hot_key = -1;
    bf.push_back(c);
    // The same edge on a narrow tile's 16-key parts: rows 78..89, the first
    // row's diagonal one key short of a part's end (keys 64..79), key 79 hot.
    c = Case<Bf16>();
    c.name = "bf16 d64 rows 78..89 of 90x250 causal: narrow, diagonal one key short of a part";
    c.D = 64, c.s_q = 90, c.s_kv = 250, c.share = 1.0, c.causal = true, c.H = 1, c.Hkv = 1;
    c.first_affected = 78, c.hot_key = 79;
    bf.push_back(c);
    // s_kv one key short of a 32- and a 16-key part (191): a part holding
    // s_kv left unmasked would put P = 2^101 on a zero key (fp16 below).
    c = Case<Bf16>();
    c.name = "bf16 d64 all rows 70x191: s_kv one key short of a part";
    c.s_kv = 191;
    bf.push_back(c);
    c.name = "bf16 d128 one row per head 40x191: narrow, s_kv one key short of a part";
    c.D = 128, c.s_q = 40, c.share = -1;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d64 many empty items, grid 1";
    c.B = 2, c.H = 3, c.Hkv = 1, c.s_q = 1400, c.s_kv = 40, c.share = -1, c.slots = 1;
    bf.push_back(c);
    // Runs of items that start and end inside heads: a block resumes a head at
    // its tile 3 (finding ranks 192.. from row 0), and only the block that
    // holds tile 0 zeroes the -inf rows and counts the head.
    c = Case<Bf16>();
    c.name = "bf16 d64 all rows 300x40, runs across heads";
    c.H = 3, c.Hkv = 3, c.s_q = 300, c.s_kv = 40, c.share = 1.0, c.slots = 4;
    bf.push_back(c);
    // Ranks that straddle the 512-row rounds of the row walk, resumed by the
    // next tile and by the next block's run; about 6 tiles of work per head,
    // every third of its 18 items.
    c.name = "bf16 d64 share 0.3 1100x40 row bias masked rows, runs across rounds";
    c.H = 2, c.Hkv = 2, c.s_q = 1100, c.share = 0.3, c.slots = 5;
    c.bias = Case<Bf16>::kRows, c.masked_rows = 5;
    bf.push_back(c);
    // Every row of a head affected: 1024 rows are exactly two 512-row rounds
    // of the row walk (the 64-row tiles end on a round's last row), 1030
    // spill 6 rows into a third.
    c = Case<Bf16>();
    c.name = "bf16 d64 all rows 1024x40, two full walk rounds";
    c.H = 1, c.Hkv = 1, c.s_q = 1024, c.s_kv = 40, c.share = 1.0, c.slots = 5;
    bf.push_back(c);
    c.name = "bf16 d64 all rows 1030x40, a third walk round of 6 rows";
    c.s_q = 1030;
    bf.push_back(c);
    // One tile per head and several heads per block's run: heads with and
    // without their one row, each counted and recomputed by its own block.
    c = Case<Bf16>();
    c.name = "bf16 d64 share 0.5 s_q 1, 10 heads on 3 blocks";
    c.B = 2, c.H = 5, c.Hkv = 5, c.s_q = 1, c.s_kv = 40, c.share = 0.5, c.slots = 3;
    bf.push_back(c);
    c.name = "bf16 d64 gqa share 0.3 s_q 20, 6 heads on 2 blocks";
    c.B = 1, c.H = 6, c.Hkv = 3, c.s_q = 20, c.share = 0.3, c.slots = 2;
    bf.push_back(c);
    // 7 tiles per head and a number of tiles of work that does not divide
    // it: 3 (150 rows) at tiles 0, 2, 4 of a head, runs of 4 and 5 items.
    c = Case<Bf16>();
    c.name = "bf16 d64 448x40, 150 rows per head: 3 tiles of work of 7";
    c.H = 2, c.Hkv = 2, c.s_q = 448, c.s_kv = 40, c.rows_per_head = 150, c.slots = 3;
    bf.push_back(c);
    // Narrow tiles (16 rows of Q, dO and bias loaded) at the other widths,
    // with and without vector loads, and after a wide tile in the same block.
    c = Case<Bf16>();
    c.name = "bf16 d256 40x150, one row per head, full bias, causal: narrow, Q from smem";
    c.D = 256, c.s_q = 40, c.s_kv = 150, c.share = -1, c.bias = Case<Bf16>::kFull, c.causal = true;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d256 40x150, 10 rows per head, padded rows: narrow, element loads";
    c.D = 256, c.s_q = 40, c.s_kv = 150, c.rows_per_head = 10, c.layout = Layout::kPadded;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d8 40x100, one row per head, row bias: narrow, one column tile";
    c.D = 8, c.s_q = 40, c.s_kv = 100, c.share = -1, c.bias = Case<Bf16>::kRows;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d72 200x100, 70 rows per head, one block, full bias: wide then narrow";
    c.D = 72, c.s_q = 200, c.s_kv = 100, c.rows_per_head = 70, c.slots = 1;
    c.bias = Case<Bf16>::kFull;
    bf.push_back(c);
    // Clusters of two blocks (sm_90): a head's only tile, narrow and at
    // least kSplitMinKeyBlocks (24) key blocks long, split between them by
    // keys (25 key blocks: 12 and 13); every other tile to one block in
    // turn. Runs across heads (3 heads on 2 clusters), causal rows whose
    // keys end one key block short of a split and right at it, 2 stages (the
    // sums land in the pipeline's second stage), head_dim 256 (Q and dO from
    // shared memory), a full bias, and runs mixing split and whole tiles.
    c = Case<Bf16>();
    c.name = "bf16 d128 one row per head 40x1540, clusters of 2: split 12 + 13 key blocks";
    c.D = 128, c.H = 3, c.Hkv = 3, c.s_q = 40, c.s_kv = 1540, c.share = -1, c.slots = 2;
    c.cluster = 2;
    bf.push_back(c);
    c.name = "bf16 d128 one row per head 40x1540, clusters of 2, 2 stages";
    c.stages = 2;
    bf.push_back(c);
    c.name = "bf16 d128 one row per head 40x300, clusters of 2: 5 key blocks, in turn";
    c.s_kv = 300, c.stages = 0;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d64 rows 1460..1469 of 1470x1470 causal, clusters of 2: 23 key blocks, whole";
    c.H = 2, c.Hkv = 2, c.s_q = 1470, c.s_kv = 1470, c.causal = true, c.share = 1.0;
    c.first_affected = 1460, c.slots = 2, c.cluster = 2;
    bf.push_back(c);
    c.name = "bf16 d64 rows 1526..1535 of 1536x1536 causal, clusters of 2: 24 key blocks, split";
    c.s_q = 1536, c.s_kv = 1536, c.first_affected = 1526;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d72 padded 200x100, 10 rows per head, full bias, clusters of 2: in turn";
    c.D = 72, c.s_q = 200, c.s_kv = 100, c.rows_per_head = 10, c.layout = Layout::kPadded;
    c.bias = Case<Bf16>::kFull, c.slots = 1, c.cluster = 2;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d256 40x1540, one row per head, full bias, clusters of 2: split, Q from smem";
    c.D = 256, c.s_q = 40, c.s_kv = 1540, c.share = -1, c.bias = Case<Bf16>::kFull;
    c.H = 2, c.Hkv = 2, c.slots = 1, c.cluster = 2;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d64 share 0.05 300x1540, clusters of 2: split and whole tiles in a run";
    c.H = 5, c.Hkv = 5, c.s_q = 300, c.s_kv = 1540, c.share = 0.05, c.slots = 3, c.cluster = 2;
    c.bias = Case<Bf16>::kRows, c.masked_rows = 2;
    bf.push_back(c);
    c = Case<Bf16>();
    c.name = "bf16 d64 448x40, 150 rows per head, clusters of 2: whole tiles in turn";
    c.H = 2, c.Hkv = 2, c.s_q = 448, c.s_kv = 40, c.rows_per_head = 150, c.slots = 2;
    c.cluster = 2;
    bf.push_back(c);
    Case<Fp16> f;
    // 2 tiles of work (100 rows) at tiles 0 and 3, runs of 3 and 4 items.
    f.name = "fp16 d64 448x40, 100 rows per head: 2 tiles of work of 7";
    f.H = 2, f.Hkv = 2, f.s_q = 448, f.s_kv = 40, f.rows_per_head = 100, f.slots = 4;
    fp.push_back(f);
    // fp16 centres the keys, so a key past s_kv left unmasked (P = 2^101 on a
    // zero key) enters dS's sum and overflows (bf16 cannot show it).
    f = Case<Fp16>();
    f.name = "fp16 d64 all rows 70x191: s_kv one key short of a part";
    f.s_kv = 191;
    fp.push_back(f);
    f.name = "fp16 d64 one row per head 40x191: narrow, s_kv one key short of a part";
    f.s_q = 40, f.share = -1;
    fp.push_back(f);
    f = Case<Fp16>();
    f.name = "fp16 d128 share 0.4 130x100";
    f.D = 128, f.s_q = 130, f.s_kv = 100, f.share = 0.4;
    fp.push_back(f);
    f.name = "fp16 d64 bshd key bias one per head";
    f.D = 64, f.s_q = 50, f.s_kv = 200, f.share = -1, f.layout = Layout::kBshd;
    f.bias = Case<Fp16>::kKeyPad;
    fp.push_back(f);
    // Narrow fp16 tiles (centred keys) at widths 256 and 128, element loads.
    f = Case<Fp16>();
    f.name = "fp16 d256 40x150, one row per head, full bias: narrow";
    f.D = 256, f.s_q = 40, f.s_kv = 150, f.share = -1, f.bias = Case<Fp16>::kFull;
    fp.push_back(f);
    f = Case<Fp16>();
    f.name = "fp16 d72 60x130, 5 rows per head, padded, full bias, 2 stages: narrow";
    f.D = 72, f.s_q = 60, f.s_kv = 130, f.rows_per_head = 5, f.layout = Layout::kPadded;
    f.bias = Case<Fp16>::kFull, f.stages = 2;
    fp.push_back(f);
    f = Case<Fp16>();
    f.name = "fp16 d120 80x70, 16 rows per head, one block: narrow at its largest";
    f.D = 120, f.s_q = 80, f.s_kv = 70, f.rows_per_head = 16, f.slots = 1;
    fp.push_back(f);
    // Centred keys take one mean: fp16 tiles are never split, and a cluster
    // takes them in turn.
    f = Case<Fp16>();
    f.name = "fp16 d64 one row per head 50x1540, clusters of 2: whole tiles in turn";
    f.H = 3, f.Hkv = 3, f.s_q = 50, f.s_kv = 1540, f.share = -1, f.slots = 2, f.cluster = 2;
    fp.push_back(f);
  }
  for (const bool drift : {false, true}) {
    emu::eager_copies = emu::skew = drift;
    auto run_all = [&](const auto& cases) {
      for (const auto& c : cases) {
        for (const bool wgmma : {false, true}) {
          if (wgmma && head_dim_width(c.D) > 128) continue;  // head_dim 256 has no wgmma path
          DYNAMIC_SECTION(c.name << (wgmma ? ", wgmma" : "")
                                 << (drift ? ", eager copies, warps drifting" : "")) {
            run_case(c, wgmma);
          }
        }
      }
    };
    run_all(bf);
    run_all(fp);
  }
  emu::eager_copies = emu::skew = false;
}
