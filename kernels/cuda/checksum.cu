// CRC-32C (Castagnoli; reflected polynomial 0x82F63B78, initial value and final
// xor 0xFFFFFFFF) of whole KV pages on the device: the page checksum of the KV
// transfer (transfer::checksum::page_checksum, the `crc32c` crate), so a page
// leaving or landing in device memory is checked without copying it to the host.
//
// One block per page: each thread computes the CRC of one contiguous chunk
// (byte-wise, table in shared memory), then thread 0 joins the chunk CRCs in order
// with zlib's crc32_combine (multmodp/x2nmodp, Adler & Madler, zlib 1.2.12):
// crc(A B) = (x^(8 |B|) mod P) * crc(A) xor crc(B) in GF(2)[x] / P.
// kernels/src/cuda/crc_math.rs mirrors this arithmetic on the host and is tested
// against the crc32c crate.
#include "tessera_common.cuh"

#define CRC32C_POLY 0x82F63B78u

// a * b mod P (reflected bit order: bit 31 is x^0).
__device__ __forceinline__ u32 multmodp(u32 a, u32 b) {
    u32 m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
        if (m == 0) break;  // a == 0
    }
    return p;
}

// x^(8 n) mod P, from x2n[k] = x^(2^k) mod P.
__device__ u32 x8nmodp(u64 n, const u32* x2n) {
    u32 p = 1u << 31;  // x^0
    u32 k = 3;
    while (n) {
        if (n & 1) p = multmodp(x2n[k & 31], p);
        n >>= 1;
        ++k;
    }
    return p;
}

// out[i] = CRC-32C of page pages[i] (page_bytes bytes at pool + pages[i] * page_bytes);
// 0 for a page index >= n_pages. Grid n (one block per page); block 256.
extern "C" __global__ void page_crc32c(const u8* __restrict__ pool, u64 page_bytes,
                                       const u32* __restrict__ pages, u32 n_pages,
                                       u32* __restrict__ out) {
    __shared__ u32 table[256];
    __shared__ u32 chunk_crc[256];
    __shared__ u32 x2n[32];
    const u32 tid = threadIdx.x, nt = blockDim.x;
    for (u32 i = tid; i < 256; i += nt) {
        u32 c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        table[i] = c;
    }
    if (tid == 0) {
        u32 p = 1u << 30;  // x^1
        x2n[0] = p;
        for (int k = 1; k < 32; ++k) x2n[k] = p = multmodp(p, p);
    }
    __syncthreads();
    const u32 page = pages[blockIdx.x];
    if (page >= n_pages) {
        if (tid == 0) out[blockIdx.x] = 0;
        return;
    }
    const u8* data = pool + (u64)page * page_bytes;
    const u64 chunk = (page_bytes + nt - 1) / nt;
    const u64 lo = min((u64)tid * chunk, page_bytes), hi = min(lo + chunk, page_bytes);
    u32 c = 0xffffffffu;
    for (u64 i = lo; i < hi; ++i) c = table[(c ^ data[i]) & 0xffu] ^ (c >> 8);
    chunk_crc[tid] = c ^ 0xffffffffu;  // standard CRC of the chunk (0 when empty)
    __syncthreads();
    if (tid == 0) {
        const u32 x_chunk = x8nmodp(chunk, x2n);
        u32 crc = chunk_crc[0];
        for (u32 t = 1; t < nt; ++t) {
            const u64 l0 = min((u64)t * chunk, page_bytes), l1 = min(l0 + chunk, page_bytes);
            if (l1 == l0) break;
            const u32 shift = (l1 - l0 == chunk) ? x_chunk : x8nmodp(l1 - l0, x2n);
            crc = multmodp(shift, crc) ^ chunk_crc[t];
        }
        out[blockIdx.x] = crc;
    }
}
