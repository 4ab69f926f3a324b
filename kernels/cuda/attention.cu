// Paged attention over tagged KV pages (K 16-bit, V 8-bit), the K/V store that fills them, and
// the tag array's writes and checks (DESIGN.md §2 I3, §5).
//
// Every kernel that touches a page first compares the page's tag in the device tag
// array with the tag the sequence's block-table entry expects (tenant, sequence,
// epoch, logical block). A mismatch (or a block-table entry out of range) is recorded in
// the sequence's failure word (`slot_fail[slot]`, atomicMin of the logical block),
// the page is neither read nor written, and the row's output is zero. The engine
// reads the failure words after the step and fails exactly those sequences.
//
// Arithmetic: the online softmax of Milakov & Gimelshein (2018), as organised in
// FlashAttention-2 (Dao 2023): per query row and head, running maximum `m`, sum
// `l` and output `acc`, rescaled by 2^(m_old - m_new) per tile of 32 keys; scores
// in base 2 with log2(e)/sqrt(head_dim) folded into q. K and V are dequantized from
// the page on the fly (k = i16 pair element * k_scale, v = byte as i8 * v_scale, see
// KvLayout). f32 throughout.
#include "tessera_common.cuh"

// Largest stored K magnitude (KvLayout's K_MAX in kernels/src/page.rs).
#define TESSERA_K_MAX 16383.f

#define MAX_DIMS_PER_LANE 8  // head_dim <= 256

// Causal paged attention for prefill and decode rows alike, with grouped-query
// attention (query head h reads KV head h / (n_heads / kv_heads)).
//
// Grid (rows, kv_heads); block 32 * group threads (one warp per query head of the
// KV head); dynamic shared memory group * head_dim * 4 bytes.
// q:   row r, head h at q[r * q_stride + h * head_dim] (f32, RoPE applied).
// out: row r, head h at out[r * out_stride + h * head_dim] (f32); zero when the
//      row's sequence failed a check.
// check_tags = 0 skips the tag comparison (benchmarks only); bounds are always checked.
extern "C" __global__ void paged_attention(const float* __restrict__ q, u32 q_stride,
                                           float* __restrict__ out, u32 out_stride,
                                           const u8* __restrict__ pool,
                                           const PageTag* __restrict__ tags, KvGeom g,
                                           SeqTables t, u32 layer, u32 n_heads,
                                           u32 check_tags, float scale_log2) {
    extern __shared__ float q_shared[];
    const u32 row = blockIdx.x, kvh = blockIdx.y;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 group = n_heads / g.kv_heads;
    const u32 h = kvh * group + warp;
    const u32 hd = g.head_dim, ps = g.page_size, nd = hd / 32;
    float* qs = q_shared + warp * hd;
    for (u32 d = lane; d < hd; d += 32) {
        qs[d] = q[(u64)row * q_stride + h * hd + d] * scale_log2;
    }
    __syncwarp();

    const u32 slot = t.row_slot[row];
    const u32 nk = t.row_pos[row] + 1;
    const u32 off = t.slot_off[slot], len = t.slot_len[slot];
    const u64 head_off = (u64)(layer * g.kv_heads + kvh) * g.head_bytes;
    const float2* q2 = reinterpret_cast<const float2*>(qs);

    float acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) acc[i] = 0.f;
    float m = NEG_INF, l = 0.f;
    bool failed = false;

    for (u32 t0 = 0; t0 < nk; t0 += 32) {
        // 1. The tags of the pages this tile reads, before any of their bytes.
        const u32 b_first = t0 / ps, b_last = min(t0 + 31, nk - 1) / ps;
        u32 b = b_first + lane;
        bool bad = false;
        if (b <= b_last) {
            if (b >= len) {
                bad = true;
            } else {
                const u32 page = t.tbl_page[off + b];
                if (page >= g.n_pages) {
                    bad = true;
                } else if (check_tags) {
                    bad = !tag_matches(tags[page], t.tbl_tag[off + b], b);
                }
            }
        }
        const u32 bad_mask = __ballot_sync(FULL_MASK, bad);
        if (bad_mask) {
            if (lane == (u32)(__ffs(bad_mask) - 1)) atomicMin(&t.slot_fail[slot], b);
            failed = true;
            break;
        }

        // 2. Scores of keys t0 + lane (lane = key within the tile).
        const u32 key = t0 + lane;
        const bool valid = key < nk;
        u32 page = 0, s_in = 0;
        float s = NEG_INF, dv = 0.f;
        if (valid) {
            b = key / ps;
            s_in = key - b * ps;
            page = t.tbl_page[off + b];
            const u8* hb = pool + (u64)page * g.page_bytes + head_off;
            float dot = 0.f;
            for (u32 pr = 0; pr < hd / 2; ++pr) {
                const u32 w = *reinterpret_cast<const u32*>(hb + pr * ps * 4 + s_in * 4);
                const float2 qv = q2[pr];
                dot += (float)(short)(w & 0xffffu) * qv.x;
                dot += (float)(short)(w >> 16) * qv.y;
            }
            s = dot * *reinterpret_cast<const float*>(hb + g.k_scale_off + s_in * 4);
            dv = *reinterpret_cast<const float*>(hb + g.v_scale_off + s_in * 4);
        }

        // 3. Online softmax update (base 2).
        const float m_new = fmaxf(m, warp_max(s));
        const float alpha = exp2f(m - m_new);
        const float p = valid ? exp2f(s - m_new) : 0.f;
        l = l * alpha + warp_sum(p);
        const float w = valid ? p * dv : 0.f;  // never 0 * a stale scale
        m = m_new;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) acc[i] *= alpha;

        // 4. acc += w_j * v_j over the tile's keys; lane owns dims lane + 32 i.
        const u32 n_valid = min(32u, nk - t0);
        if ((ps & 3u) == 0) {
            // Keys 4k..4k+3 share a page and one 4-byte word per dimension.
            for (u32 j = 0; j < n_valid; j += 4) {
                const u32 pj = __shfl_sync(FULL_MASK, page, j);
                const u32 sj = __shfl_sync(FULL_MASK, s_in, j);
                const float w0 = __shfl_sync(FULL_MASK, w, j);
                const float w1 = __shfl_sync(FULL_MASK, w, j + 1);
                const float w2 = __shfl_sync(FULL_MASK, w, j + 2);
                const float w3 = __shfl_sync(FULL_MASK, w, j + 3);
                const u8* vb =
                    pool + (u64)pj * g.page_bytes + head_off + g.v_off + (sj / 4) * hd * 4;
#pragma unroll
                for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
                    if ((u32)i < nd) {
                        const u32 v4 = *reinterpret_cast<const u32*>(vb + (lane + 32 * i) * 4);
                        acc[i] += w0 * (float)(i8)(v4 & 0xffu) + w1 * (float)(i8)((v4 >> 8) & 0xffu) +
                                  w2 * (float)(i8)((v4 >> 16) & 0xffu) +
                                  w3 * (float)(i8)((v4 >> 24) & 0xffu);
                    }
                }
            }
        } else {
            for (u32 j = 0; j < n_valid; ++j) {
                const u32 pj = __shfl_sync(FULL_MASK, page, j);
                const u32 sj = __shfl_sync(FULL_MASK, s_in, j);
                const float wj = __shfl_sync(FULL_MASK, w, j);
                const u8* vb = pool + (u64)pj * g.page_bytes + head_off + g.v_off +
                               (sj / 4) * hd * 4 + (sj & 3u);
#pragma unroll
                for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
                    if ((u32)i < nd) acc[i] += wj * (float)(i8)vb[(lane + 32 * i) * 4];
                }
            }
        }
    }

    float* o = out + (u64)row * out_stride + h * hd;
    const float inv = (failed || !(l > 0.f)) ? 0.f : 1.f / l;
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
        if ((u32)i < nd) o[lane + 32 * i] = failed ? 0.f : acc[i] * inv;
    }
}

// Quantizes each row's K and V (after RoPE) into its slot of its page, as
// KvLayout::write_token does: per KV head, d = max|x| / max, q = round(x / d)
// (half away from zero), max = TESSERA_K_MAX for K (16-bit), 127 for V (8-bit).
// The page's tag is checked first
// (the page must be this sequence's, at this logical block and epoch); a
// mismatch records the failure and writes nothing. A sequence that already failed
// in this step writes nothing more.
//
// Grid (rows, kv_heads); block 32. K of row r, KV head h at
// qkv[r * qkv_stride + k_col + h * head_dim], V at ... + v_col + h * head_dim.
extern "C" __global__ void kv_store(const float* __restrict__ qkv, u32 qkv_stride, u32 k_col,
                                    u32 v_col, u8* __restrict__ pool,
                                    const PageTag* __restrict__ tags, KvGeom g, SeqTables t,
                                    u32 layer, u32 check_tags) {
    const u32 row = blockIdx.x, kvh = blockIdx.y, lane = threadIdx.x;
    const u32 hd = g.head_dim, ps = g.page_size, nd = hd / 32;
    const u32 slot = t.row_slot[row];
    if (t.slot_fail[slot] != TESSERA_NO_FAILURE) return;
    const u32 pos = t.row_pos[row];
    const u32 b = pos / ps, s = pos - b * ps;
    const u32 off = t.slot_off[slot], len = t.slot_len[slot];
    bool bad = b >= len;
    u32 page = 0;
    if (!bad) {
        page = t.tbl_page[off + b];
        bad = page >= g.n_pages || (check_tags && !tag_matches(tags[page], t.tbl_tag[off + b], b));
    }
    if (bad) {
        if (lane == 0) atomicMin(&t.slot_fail[slot], b);
        return;
    }
    u8* hb = pool + (u64)page * g.page_bytes + (u64)(layer * g.kv_heads + kvh) * g.head_bytes;
    for (int which = 0; which < 2; ++which) {
        const float* x = qkv + (u64)row * qkv_stride + (which ? v_col : k_col) + kvh * hd;
        float v[MAX_DIMS_PER_LANE];
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
            v[i] = (u32)i < nd ? x[lane + 32 * i] : 0.f;
            amax = fmaxf(amax, fabsf(v[i]));
        }
        amax = warp_max(amax);
        const float d = amax / (which ? 127.f : TESSERA_K_MAX);
        const float id = d > 0.f ? 1.f / d : 0.f;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
            if ((u32)i < nd) {
                const u32 dd = lane + 32 * i;
                const int qv = (int)roundf(__fmul_rn(v[i], id));
                if (which == 0) {
                    *reinterpret_cast<short*>(hb + (dd / 2) * ps * 4 + s * 4 + (dd & 1u) * 2) =
                        (short)qv;
                } else {
                    hb[g.v_off + (s / 4) * hd * 4 + dd * 4 + (s & 3u)] = (u8)(i8)qv;
                }
            }
        }
        if (lane == 0) {
            *reinterpret_cast<float*>(hb + (which ? g.v_scale_off : g.k_scale_off) + s * 4) = d;
        }
    }
}

// The tag write of a page fill: tags[pages[i]] = new_tags[i] for i < n (pages out of
// range are skipped). The host's pool decides tags (alloc, free, landing); this is
// how they reach the array the kernels check. Grid ceil(n / 256); block 256.
extern "C" __global__ void write_tags(const u32* __restrict__ pages,
                                      const PageTag* __restrict__ new_tags, u32 n,
                                      PageTag* __restrict__ tags, u32 n_pages) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && pages[i] < n_pages) tags[pages[i]] = new_tags[i];
}

// The transfer-side tag check (export source, landing sink): bad[i] = 1 when page
// pages[i] does not carry expected[i] (or is out of range), else 0.
// Grid ceil(n / 256); block 256.
extern "C" __global__ void verify_page_tags(const u32* __restrict__ pages,
                                      const PageTag* __restrict__ expected, u32 n,
                                      const PageTag* __restrict__ tags, u32 n_pages,
                                      u32* __restrict__ bad) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u32 p = pages[i];
    bad[i] = (p >= n_pages || !tag_matches(tags[p], expected[i], expected[i].logical_block))
                 ? 1u
                 : 0u;
}
