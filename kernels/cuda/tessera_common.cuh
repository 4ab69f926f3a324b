// Shared definitions of Tessera's CUDA kernels (compiled at run time by NVRTC,
// which has no system headers: only what is declared here).
//
// Layouts match the CPU side bit for bit:
// - PageTag: kernels/src/page.rs `PageTag` (#[repr(C)]: u64, u64, u32, u32 = 24 bytes).
// - KV page bytes: kernels/src/page.rs `KvLayout` (8-bit K offset-binary as
//   [hd/4][ps][4], ps f32 K scales, 8-bit V as [s4/4][hd][4], s4 f32 V scales, per
//   (layer, KV head) block, layer-major).
// - bf16: the upper 16 bits of an IEEE f32, round to nearest even (as half::bf16).
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

// Owner tag of one physical KV page (DESIGN.md §5).
struct PageTag {
    u64 tenant;
    u64 seq;
    u32 epoch;
    u32 logical_block;
};

// "No failure" in a per-sequence failure word (slot_fail[]): failures store the
// first failing logical block with atomicMin.
#define TESSERA_NO_FAILURE 0xffffffffu
#define FULL_MASK 0xffffffffu
// -inf (NVRTC has no <math.h> INFINITY).
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// IEEE half (GGUF block scales) to f32, exact.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Geometry of the KV pool (kernels/src/cuda/abi.rs `KvGeom`, same field order;
// see KvLayout for the meaning of the offsets). 48 bytes.
struct KvGeom {
    u64 page_bytes;   // bytes of one page (every layer and KV head)
    u32 head_bytes;   // bytes of one (layer, KV head) block
    u32 k_scale_off;  // K scales within a head block: head_dim * page_size
    u32 v_off;        // V values: k_scale_off + 4 * page_size
    u32 v_scale_off;  // V scales: v_off + head_dim * slots4
    u32 page_size;    // token slots per page
    u32 head_dim;     // dimensions per head (a multiple of 32, at most 256)
    u32 kv_heads;     // KV heads per layer
    u32 n_pages;      // pages in the pool (every page index is checked against it)
    u32 pad0;
    u32 pad1;
};
static_assert(sizeof(KvGeom) == 48, "KvGeom layout");

// One forward step's sequences and their block tables (kernels/src/cuda/abi.rs
// `SeqTables`): all device pointers. A "slot" is one sequence of the step; rows
// are query tokens. Each block-table entry carries the full tag its page must
// hold (a prefix-cache page carries the cache entry's sequence id, not the
// reader's). 56 bytes.
struct SeqTables {
    const u32* row_slot;      // [rows] slot of each row
    const u32* row_pos;       // [rows] position: the row attends to keys 0..=pos
    const u32* slot_off;      // [slots] first entry of the slot's block table
    const u32* slot_len;      // [slots] entries of the slot's block table
    const u32* tbl_page;      // [entries] physical page of each logical block
    const PageTag* tbl_tag;   // [entries] tag each page must carry
    u32* slot_fail;           // [slots] first failing logical block, or TESSERA_NO_FAILURE
};
static_assert(sizeof(SeqTables) == 56, "SeqTables layout");
static_assert(sizeof(PageTag) == 24, "PageTag layout");

// Whether `found` is the tag a block-table entry expects for logical block `lb`
// (the CPU's verify_tags: the whole tag, and the entry's own logical block).
__device__ __forceinline__ bool tag_matches(const PageTag& found, const PageTag& expected,
                                            u32 lb) {
    return found.tenant == expected.tenant && found.seq == expected.seq &&
           found.epoch == expected.epoch && found.logical_block == expected.logical_block &&
           expected.logical_block == lb;
}
