//! Tiled paged attention with an online softmax ("flash attention" on CPU).
//!
//! K is 16-bit and V 8-bit in the page (one `f32` scale per token and KV head, see
//! [`KvLayout`]); queries are quantized to 12 bits per row and head, so `q . k`
//! over each 64 dimensions is one exact integer dot product (`vpdpwssd` on AVX-512
//! VNNI: 32 16-bit products per instruction, 16 keys of a page per register) times
//! two scales.
//! Keys and queries are wide because at 8 bits they were the largest rounding
//! error of the forward pass (docs/benchmarks.md, perplexity). Each page is
//! read once per tile of query rows; its scores update the row's running maximum
//! `m`, sum `l` and output `o` in place (Milakov & Gimelshein 2018; Dao et al.
//! 2022), so nothing grows with the context but the loop count.
//!
//! The arithmetic of one row, fixed whatever its batch mates and however a
//! prefill is cut into query blocks, tiles or tasks (batch invariance):
//! 1. `qi = round(q / dq)` with `dq = max|q| / q_max(hd)` (`q_max` in `page`:
//!    `|qi . ki| < 2^31` over one `SCORE_SEGMENT` of 64 dimensions; a wider head
//!    sums its segments' exact integer scores as `f32`, in order); the softmax
//!    scale `log2(e) / sqrt(head_dim)` is folded into `dq`, so scores are in base 2.
//! 2. Keys are visited in chunks of [`CHUNK_KEYS`] (page-aligned), each from a
//!    fresh state `(m, l, o) = (-inf, 0, 0)`; within a chunk, in groups of
//!    [`GROUP_PAGES`] pages (aligned to the chunk start), over the slots of the
//!    row's keys `lo..nk` (`lo` 0, or the start of its sliding window, see
//!    `AttnJob::window`): `s_j = (sum qi . ki_j) * (dq * dk_j)`,
//!    `m' = max(m, max s_j)`, `a = 2^(m - m')`, `p_j = 2^(s_j - m')`,
//!    `l = l a + sum p_j`, `o = o a`, then per page, with `w_j = p_j * dv_j`
//!    quantized to 16 bits, `u_j = round(65535 w_j / max w)`:
//!    `o += (max w / 65535) * sum_j u_j v8_j` (exact integers: two passes over
//!    the high and low bytes of `u`, `vpdpbusd` on AVX-512, `vpmaddwd` on AVX2).
//! 3. Chunk states are merged in key order; `out = o / l`.
//!
//! Chunks and groups that hold none of a row's keys are skipped for that row:
//! the same bits as visiting them (a chunk without keys is the empty state,
//! which the merge skips; a group without keys leaves the state as it is), so
//! a window costs what its keys do, however long the context below it.
//!
//! Chunks exist so that a long context read by few rows (batch-1 decode) can be
//! split across threads without changing a bit: tasks compute chunk states, a
//! second pass merges them in the same order a single task would.

use crate::isa::{isa, Isa};
use crate::page::{
    q_max, quantize_sym_i16, verify_tags_in, window_start, AttnJob, BlockRef, IntegrityError,
    KvLayout, PoolKv, SCORE_SEGMENT,
};

/// Query pairs (2 dimensions each) of one exact integer partial score.
const SEGMENT_PAIRS: usize = SCORE_SEGMENT / 2;
use std::ops::Range;

/// Keys per chunk (rounded down to whole pages, at least one page).
pub(crate) const CHUNK_KEYS: usize = 512;
/// Pages per softmax update: the running maximum, rescale and 8-bit
/// probabilities are computed once per group of pages (aligned to chunk starts).
const GROUP_PAGES: usize = 4;
/// Largest probability weight (`u_j = round(W_MAX * w_j / max w)`): 16 bits.
const W_MAX: f32 = 65535.0;
/// Query tokens per unit of work (one unit: these tokens x one KV head).
const QUERY_BLOCK: usize = 16;

/// How [`run`] executes its units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exec {
    /// On the calling thread.
    Serial,
    /// On the global pool; chunk-split when there are few units.
    Parallel,
    /// On the global pool, always chunk-split (tests: must equal the others).
    #[cfg_attr(not(test), allow(dead_code))]
    ParallelSplit,
}

/// Byte geometry of a page's head blocks.
#[derive(Clone, Copy, Debug)]
struct Geo {
    ps: usize,
    hd: usize,
    page_bytes: usize,
    head_bytes: usize,
    k_scale: usize,
    v_off: usize,
    v_scale: usize,
    chunk_pages: usize,
}

impl Geo {
    fn new(l: &KvLayout) -> Self {
        Self {
            ps: l.page_size,
            hd: l.head_dim,
            page_bytes: l.page_bytes(),
            head_bytes: l.head_block_bytes(),
            k_scale: l.k_scale_offset(),
            v_off: l.v_offset(),
            v_scale: l.v_scale_offset(),
            chunk_pages: (CHUNK_KEYS / l.page_size).max(1),
        }
    }
}

/// The head blocks one unit reads: KV head `head` (layer-major index) of the
/// pages of one block table.
struct Src<'a> {
    geo: &'a Geo,
    data: &'a [u8],
    table: &'a [BlockRef],
    head: usize,
}

impl Src<'_> {
    /// Byte offset of logical block `b`'s head block in the pool.
    #[inline(always)]
    fn at(&self, b: usize) -> usize {
        let at =
            self.table[b].page as usize * self.geo.page_bytes + self.head * self.geo.head_bytes;
        assert!(
            at + self.geo.head_bytes <= self.data.len(),
            "page outside the pool"
        );
        at
    }
}

/// The query rows of one unit (tokens `t0..t1` of a job x the query heads of one
/// KV head), quantized.
struct Rows {
    /// `[r, hd]` queries in `-q_max(hd)..=q_max(hd)`.
    qq: Vec<i16>,
    /// Per row: query scale times `log2(e) / sqrt(hd)`.
    dq: Vec<f32>,
    /// Per row: keys attended are `lo..nk` (`lo` 0 without a window).
    lo: Vec<usize>,
    /// Per row: end of the keys attended (the row's key count).
    nk: Vec<usize>,
}

/// Running softmax state of `r` rows: `m`, `l` and `o` (`[r, hd]`).
#[derive(Clone, Debug)]
struct State {
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
}

impl State {
    fn empty(r: usize, hd: usize) -> Self {
        Self {
            m: vec![f32::NEG_INFINITY; r],
            l: vec![0.0; r],
            o: vec![0.0; r * hd],
        }
    }
}

/// Query tokens `t0..t1` of job `job` x KV head `g`: the rows of one
/// `Kernel::chunk` call.
#[derive(Clone, Copy, Debug)]
struct Unit {
    job: usize,
    g: usize,
    t0: usize,
    t1: usize,
    /// Chunks `c0..c1` hold every key of the rows (those below are skipped).
    c0: usize,
    c1: usize,
    /// Work estimate: keys attended summed over the rows, plus 16 per row.
    cost: usize,
}

impl Unit {
    fn chunks(&self) -> Range<usize> {
        self.c0..self.c1
    }
}

/// The chunks (of `chunk_pages` pages) that hold a key of rows `rows` of `job`,
/// and the cost estimate the schedule orders units by: the keys the rows attend
/// to, plus 16 per row (their queries, outputs and merges). Chunks below every
/// row's window are left out, so a window of 512 keys at a 32k context costs
/// what 512 keys do.
fn block_plan(
    job: &AttnJob,
    rows: Range<usize>,
    ps: usize,
    chunk_pages: usize,
) -> (Range<usize>, usize) {
    let keys = || rows.clone().map(|t| job.keys(t));
    let first = keys().map(|k| k.start).min().unwrap_or(0);
    let end = keys().map(|k| k.end).max().unwrap_or(0);
    let cost = keys().map(|k| k.len()).sum::<usize>() + 16 * rows.len();
    let c1 = end.div_ceil(ps).div_ceil(chunk_pages);
    ((first / ps / chunk_pages).min(c1)..c1, cost)
}

/// The logical blocks that hold a key some row of `job` attends to, as sorted,
/// disjoint ranges: the pages the job verifies and reads (see `AttnJob`).
fn read_blocks(job: &AttnJob, ps: usize) -> Vec<Range<usize>> {
    let mut spans: Vec<Range<usize>> = (0..job.n_keys.len())
        .map(|i| job.keys(i))
        .filter(|k| !k.is_empty())
        .map(|k| k.start / ps..k.end.div_ceil(ps))
        .collect();
    spans.sort_unstable_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(1);
    for r in spans {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Base pointer of a job's output, shared by units that write disjoint cells.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: units write disjoint (token, head) cells of buffers that outlive the
// parallel regions.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}
impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Runs every job (see `attention::paged_attention_jobs`).
pub(crate) fn run(
    pool: PoolKv,
    n_heads: usize,
    jobs: &mut [AttnJob],
    exec: Exec,
) -> Vec<Result<(), IntegrityError>> {
    let l = pool.layout;
    let (hd, kvh, ps) = (l.head_dim, l.kv_heads, l.page_size);
    assert!(
        kvh > 0 && n_heads.is_multiple_of(kvh),
        "heads {n_heads} / kv heads {kvh}"
    );
    assert!(hd.is_multiple_of(4), "head_dim must be a multiple of 4");
    let row = n_heads * hd;
    let geo = Geo::new(l);
    let mut results = Vec::with_capacity(jobs.len());
    let mut units = Vec::new();
    for (ji, job) in jobs.iter_mut().enumerate() {
        let m = job.n_keys.len();
        assert_eq!(job.q.len(), m * row, "query shape");
        assert_eq!(job.out.len(), m * row, "output shape");
        assert!(
            job.window != Some(0),
            "attention window must be at least 1 key"
        );
        let max_keys = job.n_keys.iter().copied().max().unwrap_or(0);
        let n_pages = max_keys.div_ceil(ps);
        assert!(
            job.table.len() >= n_pages,
            "block table shorter than the keys"
        );
        assert!(
            pool.data.len() >= pool.tags.len() * geo.page_bytes,
            "pool data shorter than its pages"
        );
        // I3: every page a row reads, and only those (see `AttnJob`): the
        // kernels below read no page outside these blocks.
        let verified = read_blocks(job, ps)
            .into_iter()
            .try_for_each(|blocks| verify_tags_in(pool.tags, job.table, blocks));
        if let Err(e) = verified {
            job.out.fill(0.0);
            results.push(Err(e));
            continue;
        }
        results.push(Ok(()));
        for t0 in (0..m).step_by(QUERY_BLOCK) {
            let t1 = (t0 + QUERY_BLOCK).min(m);
            let (chunks, cost) = block_plan(job, t0..t1, ps, geo.chunk_pages);
            for g in 0..kvh {
                units.push(Unit {
                    job: ji,
                    g,
                    t0,
                    t1,
                    c0: chunks.start,
                    c1: chunks.end,
                    cost,
                });
            }
        }
    }
    // Longest first, so the pool's in-order claiming balances the tail.
    units.sort_by_key(|u| std::cmp::Reverse(u.cost));
    let outs: Vec<OutPtr> = jobs
        .iter_mut()
        .map(|j| OutPtr(j.out.as_mut_ptr()))
        .collect();
    let jobs: &[AttnJob] = jobs;
    let kernel = Kernel::pick(&geo);
    let group = n_heads / kvh;

    let rows_of = |u: &Unit| -> Rows {
        let job = &jobs[u.job];
        let r = (u.t1 - u.t0) * group;
        let mut rows = Rows {
            qq: vec![0; r * hd],
            dq: vec![0.0; r],
            lo: vec![0; r],
            nk: vec![0; r],
        };
        let scale = std::f32::consts::LOG2_E / (hd as f32).sqrt();
        let qmax = q_max(hd);
        for i in 0..r {
            let (t, h) = (u.t0 + i / group, u.g * group + i % group);
            let q = &job.q[t * row + h * hd..t * row + (h + 1) * hd];
            let qq = &mut rows.qq[i * hd..(i + 1) * hd];
            rows.dq[i] = quantize_query(q, qmax, qq) * scale;
            rows.nk[i] = job.n_keys[t];
            rows.lo[i] = window_start(job.n_keys[t], job.window);
        }
        rows
    };
    let chunk = |u: &Unit, rows: &Rows, c: usize| -> State {
        let src = Src {
            geo: &geo,
            data: pool.data,
            table: jobs[u.job].table,
            head: pool.layer * kvh + u.g,
        };
        kernel.chunk(&src, rows, c)
    };
    let finish = |u: &Unit, total: &State| {
        let base = outs[u.job].get();
        for i in 0..total.m.len() {
            let (t, h) = (u.t0 + i / group, u.g * group + i % group);
            // SAFETY: (t, h) lies inside job u.job's output ([m, row]), and no other
            // unit writes token t of head h (units split tokens and KV heads).
            let out = unsafe { std::slice::from_raw_parts_mut(base.add(t * row + h * hd), hd) };
            let li = total.l[i];
            let inv = if li > 0.0 { 1.0 / li } else { 0.0 };
            for (o, &v) in out.iter_mut().zip(&total.o[i * hd..(i + 1) * hd]) {
                *o = v * inv;
            }
        }
    };
    let whole = |u: &Unit| {
        let rows = rows_of(u);
        let mut total = State::empty(rows.nk.len(), hd);
        for c in u.chunks() {
            merge(&mut total, &chunk(u, &rows, c), hd);
        }
        finish(u, &total);
    };

    let threads = crate::pool::global().threads();
    let split = match exec {
        Exec::Serial => false,
        Exec::Parallel => units.len() < 2 * threads && units.iter().any(|u| u.chunks().len() > 1),
        Exec::ParallelSplit => true,
    };
    match exec {
        Exec::Serial => units.iter().for_each(whole),
        _ if !split => crate::pool::global().parallel_for(units.len(), |i| whole(&units[i])),
        _ => {
            // Tasks compute runs of consecutive chunk states (each chunk from a
            // fresh state); the caller then merges every unit's states in key
            // order, exactly as `whole` does.
            let per_unit = (4 * threads).div_ceil(units.len()).max(1);
            let mut tasks: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
            for (ui, u) in units.iter().enumerate() {
                let step = u.chunks().len().div_ceil(per_unit).max(1);
                for c0 in u.chunks().step_by(step) {
                    tasks.push((ui, c0..(c0 + step).min(u.c1)));
                }
            }
            let states: Vec<std::sync::Mutex<Vec<State>>> = tasks
                .iter()
                .map(|_| std::sync::Mutex::new(Vec::new()))
                .collect();
            crate::pool::global().parallel_for(tasks.len(), |ti| {
                let (ui, cs) = &tasks[ti];
                let u = &units[*ui];
                let rows = rows_of(u);
                let out: Vec<State> = cs.clone().map(|c| chunk(u, &rows, c)).collect();
                *states[ti].lock().expect("chunk state lock") = out;
            });
            let mut totals: Vec<State> = units
                .iter()
                .map(|u| State::empty((u.t1 - u.t0) * group, hd))
                .collect();
            for ((ui, _), st) in tasks.iter().zip(states) {
                for c in st.into_inner().expect("chunk state lock") {
                    merge(&mut totals[*ui], &c, hd);
                }
            }
            for (u, total) in units.iter().zip(&totals) {
                finish(u, total);
            }
        }
    }
    results
}

/// [`quantize_sym_i16`] of one query row, vectorized with AVX2 where the machine
/// has it (baseline x86-64 keeps the saturating float-to-int casts scalar).
fn quantize_query(q: &[f32], qmax: i32, out: &mut [i16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa() != Isa::Scalar {
        #[target_feature(enable = "avx2,fma,sse4.1")]
        unsafe fn avx2(q: &[f32], qmax: i32, out: &mut [i16]) -> f32 {
            quantize_sym_i16(q, qmax, out)
        }
        // SAFETY: `isa()` verified AVX2 and FMA.
        return unsafe { avx2(q, qmax, out) };
    }
    quantize_sym_i16(q, qmax, out)
}

/// Folds chunk state `c` (keys after those of `t`) into `t`, row by row.
fn merge(t: &mut State, c: &State, hd: usize) {
    #[cfg(target_arch = "x86_64")]
    if isa() != Isa::Scalar {
        // SAFETY: `isa()` verified FMA (and SSE4.1 with it).
        return unsafe { merge_fma(t, c, hd) };
    }
    merge_rows(t, c, hd);
}

/// [`merge_rows`] with hardware FMA and rounding, instead of the `fmaf` and
/// `rintf` library calls that baseline x86-64 compiles `exp2` to: the same
/// correctly rounded results.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma,sse4.1")]
unsafe fn merge_fma(t: &mut State, c: &State, hd: usize) {
    merge_rows(t, c, hd);
}

#[inline(always)]
fn merge_rows(t: &mut State, c: &State, hd: usize) {
    for i in 0..t.m.len() {
        if c.m[i] == f32::NEG_INFINITY {
            continue;
        }
        let m = t.m[i].max(c.m[i]);
        let (a, b) = (exp2(t.m[i] - m), exp2(c.m[i] - m));
        t.m[i] = m;
        t.l[i] = t.l[i] * a + c.l[i] * b;
        for (x, &y) in t.o[i * hd..(i + 1) * hd]
            .iter_mut()
            .zip(&c.o[i * hd..(i + 1) * hd])
        {
            *x = *x * a + y * b;
        }
    }
}

/// Taylor coefficients of `2^f = e^(f ln 2)`, degree 7 (|f| <= 1/2: relative
/// error below 1e-8, under `f32` rounding).
const EXP2_C: [f32; 8] = [
    1.0,
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_504_11,
    0.009_618_129,
    0.001_333_355_8,
    0.000_154_035_3,
    0.000_015_252_734,
];

/// `2^x` for `x <= 0` (softmax arguments); 0 below -126 and for NaN.
#[inline(always)]
fn exp2(x: f32) -> f32 {
    // Written so that NaN takes this branch too.
    if x.is_nan() || x < -126.0 {
        return 0.0;
    }
    let n = x.round_ties_even();
    let f = x - n;
    let mut p = EXP2_C[7];
    for &c in EXP2_C[..7].iter().rev() {
        p = p.mul_add(f, c);
    }
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Sum of 16 values in the tree order of the AVX-512 kernel's reduction:
/// halves, quarters, then pairs.
#[inline(always)]
fn reduce16(v: &[f32]) -> f32 {
    let a: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
    let b: [f32; 4] = std::array::from_fn(|i| a[i] + a[i + 4]);
    (b[0] + b[2]) + (b[1] + b[3])
}

/// The chunk kernel chosen for this machine and page shape.
#[derive(Clone, Copy, Debug)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 VNNI with `hd / 16` output registers per row.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

#[cfg(test)]
thread_local! {
    /// Tests: run the portable kernel whatever the machine supports.
    pub(crate) static FORCE_PORTABLE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Kernel {
    fn pick(geo: &Geo) -> Self {
        #[cfg(test)]
        if FORCE_PORTABLE.with(|f| f.get()) {
            return Self::Portable;
        }
        match isa() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni if geo.ps <= 16 && matches!(geo.hd, 64 | 128 | 256) => Self::Avx512,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni | Isa::Avx2
                if (geo.ps == 8 || geo.ps == 16) && geo.hd.is_multiple_of(8) =>
            {
                Self::Avx2
            }
            _ => Self::Portable,
        }
    }

    /// State of every row over chunk `c` of its keys, from a fresh start.
    fn chunk(self, src: &Src, rows: &Rows, c: usize) -> State {
        let geo = src.geo;
        let mut st = State::empty(rows.nk.len(), geo.hd);
        let pages = c * geo.chunk_pages..(c + 1) * geo.chunk_pages;
        match self {
            Self::Portable => chunk_portable(src, rows, pages, &mut st),
            // SAFETY: `isa()` verified avx2, fma and f16c.
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => unsafe { chunk_avx2(src, rows, pages, &mut st) },
            // SAFETY: `isa()` verified AVX-512 F/BW/VL/VNNI; `pick` checked the shape.
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe {
                match geo.hd {
                    // 16 rows per pass over a page (a unit's 48 rows in three):
                    // each page's K and V bytes serve more rows (attention_speed
                    // prefill: 8 rows were about 8 % faster than 4, 16 another 7 %).
                    64 => avx512::chunk::<16, 4>(src, rows, pages, &mut st),
                    128 => avx512::chunk::<2, 8>(src, rows, pages, &mut st),
                    // Gemma 3: one row's 16 accumulators fill half the registers.
                    _ => avx512::chunk::<1, 16>(src, rows, pages, &mut st),
                }
            },
        }
        st
    }
}

/// Keys of a row in page `b` (0 when the row ends before it).
#[inline(always)]
fn own_keys(nk: usize, b: usize, ps: usize) -> usize {
    nk.saturating_sub(b * ps).min(ps)
}

/// Slots `j0..j1` of page `b` that hold keys of a row attending keys `lo..nk`
/// (`j0 >= j1` when none do).
#[inline(always)]
fn own_slots(lo: usize, nk: usize, b: usize, ps: usize) -> (usize, usize) {
    (lo.saturating_sub(b * ps).min(ps), own_keys(nk, b, ps))
}

/// The pages of chunk `pages` that a row (or tile of rows) attending keys from
/// `lo` to below `nk` visits, as `(first group start, end)`: the page groups
/// (aligned to the chunk start) from the one holding key `lo` up to the page of
/// key `nk - 1`; `None` when the chunk holds none of those keys. For one row
/// (keys `lo..nk`), every page from `max(lo / ps, pages.start)` to `end` holds
/// some of them, so only the first group can start with pages of none; a tile of
/// rows far apart can leave gaps.
#[inline(always)]
fn row_pages(lo: usize, nk: usize, ps: usize, pages: &Range<usize>) -> Option<(usize, usize)> {
    let end = nk.div_ceil(ps).min(pages.end);
    let first = (lo / ps).max(pages.start);
    (lo < nk && first < end).then(|| {
        let b0 = pages.start + (first - pages.start) / GROUP_PAGES * GROUP_PAGES;
        (b0, end)
    })
}

/// `sum a_i b_i` of 4 products (of bytes, or of a 16-bit pair and zeros), with
/// wrapping arithmetic so that the loops around it vectorize; exact where the
/// true sum fits `i32`, as every caller's does.
#[inline(always)]
fn dot4(a: [i32; 4], b: [i32; 4]) -> i32 {
    let p = |i: usize| a[i].wrapping_mul(b[i]);
    p(0).wrapping_add(p(1))
        .wrapping_add(p(2).wrapping_add(p(3)))
}

/// Little-endian `f32` at byte `at`.
#[inline(always)]
fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The AVX2 kernel (page sizes 8 and 16, `head_dim` a multiple of 8): one row at
/// a time, 8 slots per register; per row the operations of [`chunk_portable`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk_avx2(src: &Src, rows: &Rows, pages: std::ops::Range<usize>, st: &mut State) {
    use std::arch::x86_64::*;
    let geo = src.geo;
    let (ps, hd) = (geo.ps, geo.hd);
    let halves = ps / 8;
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    let lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    // `2^x` per lane as `exp2` computes it.
    let exp2v = |x: __m256| {
        let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(-126.0));
        let x = _mm256_max_ps(x, _mm256_set1_ps(-126.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm256_sub_ps(x, n);
        let mut p = _mm256_set1_ps(EXP2_C[7]);
        for &c in EXP2_C[..7].iter().rev() {
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
        }
        let pow = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(pow)), keep)
    };
    let hmax = |v: __m256| {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    };
    for i in 0..rows.nk.len() {
        // Pairs of 16-bit query values, one `i32` per pair.
        let qq = rows.qq[i * hd..].as_ptr().cast::<i32>();
        let dq = _mm256_set1_ps(rows.dq[i]);
        let (lo, nk) = (rows.lo[i], rows.nk[i]);
        let mut m = f32::NEG_INFINITY;
        let mut lv = [_mm256_setzero_ps(); 2];
        let o = &mut st.o[i * hd..(i + 1) * hd];
        let (mut b0, end) = row_pages(lo, nk, ps, &pages).unwrap_or((0, 0));
        while b0 < end {
            let b1 = (b0 + GROUP_PAGES).min(end);
            let mut s = [[neg_inf; 2]; GROUP_PAGES];
            let mut dv = [[_mm256_setzero_ps(); 2]; GROUP_PAGES];
            let mut at = [0usize; GROUP_PAGES];
            // Per page: the row's slots j0..j1 (empty: a page before its window).
            let mut own = [(0usize, 0usize); GROUP_PAGES];
            let mut mp = f32::NEG_INFINITY;
            for b in b0..b1 {
                let g = b - b0;
                own[g] = own_slots(lo, nk, b, ps);
                if own[g].0 >= own[g].1 {
                    continue;
                }
                at[g] = src.at(b);
                let hb = src.data[at[g]..at[g] + geo.head_bytes].as_ptr();
                for h in 0..halves {
                    // Two accumulators (even and odd pairs): shorter dependent
                    // chains, the same integer sum.
                    let mut isum2 = [_mm256_setzero_si256(); 2];
                    // Finished segments' scores (see `SCORE_SEGMENT`).
                    let mut done = _mm256_setzero_ps();
                    for pair in 0..hd / 2 {
                        if pair > 0 && pair % SEGMENT_PAIRS == 0 {
                            let seg = _mm256_add_epi32(isum2[0], isum2[1]);
                            done = _mm256_add_ps(done, _mm256_cvtepi32_ps(seg));
                            isum2 = [_mm256_setzero_si256(); 2];
                        }
                        // SAFETY: the head block holds hd/2 rows of ps*4 K bytes;
                        // the row has hd / 2 query pairs.
                        let (k, q2) = unsafe {
                            (
                                _mm256_loadu_si256(hb.add(pair * ps * 4 + h * 32).cast()),
                                _mm256_set1_epi32(std::ptr::read_unaligned(qq.add(pair))),
                            )
                        };
                        let a = &mut isum2[pair % 2];
                        *a = _mm256_add_epi32(*a, _mm256_madd_epi16(k, q2));
                    }
                    let isum = _mm256_add_epi32(isum2[0], isum2[1]);
                    // SAFETY: ps K scales and ps V scales in the head block.
                    let (dk, v) = unsafe {
                        (
                            _mm256_loadu_ps(hb.add(geo.k_scale + h * 32).cast()),
                            _mm256_loadu_ps(hb.add(geo.v_scale + h * 32).cast()),
                        )
                    };
                    let x = _mm256_add_ps(done, _mm256_cvtepi32_ps(isum));
                    let x = _mm256_mul_ps(x, _mm256_mul_ps(dq, dk));
                    // Lanes of slots j0 <= 8 h + lane < j1.
                    let (j0, j1) = (
                        own[g].0 as i32 - 8 * h as i32,
                        own[g].1 as i32 - 8 * h as i32,
                    );
                    let valid = _mm256_and_si256(
                        _mm256_cmpgt_epi32(_mm256_set1_epi32(j1), lane_ids),
                        _mm256_cmpgt_epi32(lane_ids, _mm256_set1_epi32(j0 - 1)),
                    );
                    s[g][h] = _mm256_blendv_ps(neg_inf, x, _mm256_castsi256_ps(valid));
                    dv[g][h] = _mm256_and_ps(v, _mm256_castsi256_ps(valid));
                    mp = mp.max(hmax(s[g][h]));
                }
            }
            let m_new = m.max(mp);
            let alpha = exp2(m - m_new);
            m = m_new;
            let a = _mm256_set1_ps(alpha);
            for x in o.chunks_exact_mut(8) {
                // SAFETY: 8 floats.
                unsafe {
                    _mm256_storeu_ps(
                        x.as_mut_ptr(),
                        _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr()), a),
                    )
                };
            }
            let mut psum = [_mm256_setzero_ps(); 2];
            for g in 0..b1 - b0 {
                let (j0, j1) = own[g];
                if j0 >= j1 {
                    continue;
                }
                let mut w = [_mm256_setzero_ps(); 2];
                let mut wmax = 0f32;
                for h in 0..halves {
                    let p = exp2v(_mm256_sub_ps(s[g][h], _mm256_set1_ps(m_new)));
                    psum[h] = _mm256_add_ps(psum[h], p);
                    w[h] = _mm256_mul_ps(p, dv[g][h]);
                    wmax = wmax.max(hmax(w[h]));
                }
                if wmax.is_nan() || wmax <= 0.0 {
                    continue;
                }
                let (sc, inv) = (wmax / W_MAX, _mm256_set1_ps(W_MAX / wmax));
                let lim = _mm256_set1_epi32(W_MAX as i32);
                let u: [__m256i; 2] = std::array::from_fn(|h| {
                    if h < halves {
                        _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(w[h], inv)), lim)
                    } else {
                        _mm256_setzero_si256()
                    }
                });
                // The 16 weights' high and low bytes as i16, in slot order.
                let byte = _mm256_set1_epi32(255);
                let split = |f: &dyn Fn(__m256i) -> __m256i| -> [__m256i; 4] {
                    let v = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(f(u[0]), f(u[1])));
                    let mut uw = [0i64; 4];
                    // SAFETY: 32 bytes into a 32-byte array.
                    unsafe { _mm256_storeu_si256(uw.as_mut_ptr().cast(), v) };
                    std::array::from_fn(|j| _mm256_set1_epi64x(uw[j]))
                };
                let uh = split(&|x| _mm256_srli_epi32::<8>(x));
                let ul = split(&|x| _mm256_and_si256(x, byte));
                let nq = j1.div_ceil(4);
                let vp = src.data
                    [at[g] + geo.v_off..at[g] + geo.v_off + hd * geo.ps.next_multiple_of(4)]
                    .as_ptr();
                let sc4 = _mm_set1_ps(sc);
                for d4 in 0..hd / 4 {
                    // Dimensions 4*d4..4*d4+4: lanes are (dimension, slot pair).
                    let (mut hi, mut lw) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                    // From the quad of slot j0: earlier slots' weights are 0.
                    for j in j0 / 4..nq {
                        // SAFETY: quad j < slots4 / 4 holds hd * 4 V bytes.
                        let v = unsafe { _mm_loadu_si128(vp.add(j * hd * 4 + d4 * 16).cast()) };
                        let v = _mm256_cvtepi8_epi16(v);
                        hi = _mm256_add_epi32(hi, _mm256_madd_epi16(v, uh[j]));
                        lw = _mm256_add_epi32(lw, _mm256_madd_epi16(v, ul[j]));
                    }
                    let acc = _mm256_add_epi32(_mm256_slli_epi32::<8>(hi), lw);
                    let t = _mm256_hadd_epi32(acc, acc);
                    let sums = _mm_unpacklo_epi64(
                        _mm256_castsi256_si128(t),
                        _mm256_extracti128_si256::<1>(t),
                    );
                    let x = o[d4 * 4..].as_mut_ptr();
                    // SAFETY: 4 floats of the row.
                    unsafe {
                        _mm_storeu_ps(x, _mm_fmadd_ps(_mm_cvtepi32_ps(sums), sc4, _mm_loadu_ps(x)))
                    };
                }
            }
            for h in 0..2 {
                lv[h] = _mm256_fmadd_ps(lv[h], a, psum[h]);
            }
            b0 = b1;
        }
        st.m[i] = m;
        let mut l16 = [0f32; 16];
        // SAFETY: 16 floats.
        unsafe {
            _mm256_storeu_ps(l16.as_mut_ptr(), lv[0]);
            _mm256_storeu_ps(l16[8..].as_mut_ptr(), lv[1]);
        }
        st.l[i] = reduce16(&l16);
    }
}

/// The reference kernel: the module's arithmetic, one row at a time, page
/// groups as in the AVX-512 kernel.
#[inline(always)]
fn chunk_portable(src: &Src, rows: &Rows, pages: std::ops::Range<usize>, st: &mut State) {
    let geo = src.geo;
    let (ps, hd) = (geo.ps, geo.hd);
    let gk = GROUP_PAGES * geo.ps.next_multiple_of(4);
    // Scores, V scales and 8-bit weights of one page group (slots padded to 4).
    let (mut s, mut dv, mut u) = (vec![0f32; gk], vec![0f32; gk], vec![0i32; gk]);
    let mut isum = vec![0i32; ps];
    // Finished segments' scores per slot (see `SCORE_SEGMENT`).
    let mut done = vec![0f32; ps];
    let mut acc = vec![0i32; hd];
    let p4 = ps.next_multiple_of(4);
    // Running sums of probabilities per slot lane, reduced at the end of the
    // chunk (as the AVX-512 kernel keeps them in a register).
    let lanes = ps.next_multiple_of(16);
    let (mut lv, mut psum) = (vec![0f32; lanes], vec![0f32; lanes]);
    for i in 0..rows.nk.len() {
        let qq = &rows.qq[i * hd..(i + 1) * hd];
        let (lo, nk) = (rows.lo[i], rows.nk[i]);
        let mut m = f32::NEG_INFINITY;
        lv.fill(0.0);
        let o = &mut st.o[i * hd..(i + 1) * hd];
        let (mut b0, end) = row_pages(lo, nk, ps, &pages).unwrap_or((0, 0));
        while b0 < end {
            let b1 = (b0 + GROUP_PAGES).min(end);
            let mut mp = f32::NEG_INFINITY;
            for b in b0..b1 {
                let (j0, j1) = own_slots(lo, nk, b, ps);
                if j0 >= j1 {
                    continue;
                }
                let at = src.at(b);
                let hb = &src.data[at..at + geo.head_bytes];
                isum[j0..j1].fill(0);
                done[j0..j1].fill(0.0);
                for (pair, q) in qq.chunks_exact(2).enumerate() {
                    if pair > 0 && pair % SEGMENT_PAIRS == 0 {
                        for (d, a) in done[j0..j1].iter_mut().zip(&mut isum[j0..j1]) {
                            *d += *a as f32;
                            *a = 0;
                        }
                    }
                    let k = &hb[pair * ps * 4 + j0 * 4..pair * ps * 4 + j1 * 4];
                    for (a, k) in isum[j0..j1].iter_mut().zip(k.chunks_exact(4)) {
                        let k0 = i16::from_le_bytes([k[0], k[1]]) as i32;
                        let k1 = i16::from_le_bytes([k[2], k[3]]) as i32;
                        *a = a.wrapping_add(dot4([k0, k1, 0, 0], [q[0] as i32, q[1] as i32, 0, 0]));
                    }
                }
                let g = (b - b0) * p4;
                for j in j0..j1 {
                    let x = done[j] + isum[j] as f32;
                    s[g + j] = x * (rows.dq[i] * f32_at(hb, geo.k_scale + j * 4));
                    dv[g + j] = f32_at(hb, geo.v_scale + j * 4);
                    mp = mp.max(s[g + j]);
                }
            }
            let m_new = m.max(mp);
            let alpha = exp2(m - m_new);
            m = m_new;
            psum.fill(0.0);
            o.iter_mut().for_each(|x| *x *= alpha);
            for b in b0..b1 {
                let ((j0, j1), g) = (own_slots(lo, nk, b, ps), (b - b0) * p4);
                if j0 >= j1 {
                    continue;
                }
                // Probabilities times V scales, as 16-bit fractions of the page's maximum.
                let mut wmax = 0f32;
                for j in g + j0..g + j1 {
                    let p = exp2(s[j] - m_new);
                    psum[j - g] += p;
                    s[j] = p * dv[j];
                    wmax = wmax.max(s[j]);
                }
                if wmax.is_nan() || wmax <= 0.0 {
                    continue;
                }
                let (sc, inv) = (wmax / W_MAX, W_MAX / wmax);
                u[g..g + p4].fill(0);
                for j in g + j0..g + j1 {
                    u[j] = ((s[j] * inv).round_ties_even() as i32).min(W_MAX as i32);
                }
                acc.fill(0);
                let at = src.at(b) + geo.v_off;
                // Quads from the one of slot j0: the weights of the slots
                // before it are 0 (integer sums: the same either way).
                for quad in j0 / 4..j1.div_ceil(4) {
                    let w = &u[g + quad * 4..g + quad * 4 + 4];
                    let v = &src.data[at + quad * hd * 4..at + (quad + 1) * hd * 4];
                    for (a, v) in acc.iter_mut().zip(v.chunks_exact(4)) {
                        let v = [v[0] as i8, v[1] as i8, v[2] as i8, v[3] as i8];
                        *a = a.wrapping_add(dot4([w[0], w[1], w[2], w[3]], v.map(|x| x as i32)));
                    }
                }
                for (x, &a) in o.iter_mut().zip(&acc) {
                    *x = (a as f32).mul_add(sc, *x);
                }
            }
            for (l, &p) in lv.iter_mut().zip(&psum) {
                *l = l.mul_add(alpha, p);
            }
            b0 = b1;
        }
        st.m[i] = m;
        st.l[i] = lv.chunks_exact(16).map(reduce16).sum();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// `vpshufb` control: in each 128-bit block of 4 dwords `[lo, hi, 0, 0]`,
    /// the 4 low bytes to dword 0 and the 4 high bytes to dword 1 (rest zeroed).
    const BYTES_LO_HI: __m512i = unsafe {
        std::mem::transmute::<[i8; 64], __m512i>({
            let mut c = [-128i8; 64];
            let mut blk = 0;
            while blk < 4 {
                let mut j = 0;
                while j < 4 {
                    c[blk * 16 + j] = (4 * j) as i8;
                    c[blk * 16 + 4 + j] = (4 * j + 1) as i8;
                    j += 1;
                }
                blk += 1;
            }
            c
        })
    };
    /// `vpermd` indices: dword 0 of each block (low bytes), then dword 1 (high).
    const DWORDS_LO_HI: __m512i = unsafe {
        std::mem::transmute::<[i32; 16], __m512i>([
            0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0,
        ])
    };

    /// `2^x` in every lane for `x <= 0`; 0 below -126 and for NaN.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp2_ps(x: __m512) -> __m512 {
        let lo = _mm512_set1_ps(-126.0);
        let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, lo);
        let x = _mm512_max_ps(x, lo);
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm512_sub_ps(x, n);
        let mut p = _mm512_set1_ps(EXP2_C[7]);
        for &c in EXP2_C[..7].iter().rev() {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n))
    }

    /// `acc + a . b` over 16-bit pairs as one `vpdpwssd`. Written in assembly
    /// because LLVM's generic tuning splits some `vpdpwssd`s into `vpmaddwd` +
    /// `vpaddd` to shorten dependency chains; here the chains are already short and
    /// the second instruction only takes issue slots from the score loop.
    ///
    /// The second operand is the 32-bit pair at `b.add(i)`, broadcast by the
    /// instruction's memory form: one fused uop instead of a broadcast load and a
    /// register `vpdpwssd`.
    ///
    /// # Safety
    /// `b.add(i)` must be readable for 4 bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dpwssd_bcst(acc: __m512i, a: __m512i, b: *const i32, i: usize) -> __m512i {
        let mut acc = acc;
        // SAFETY: the caller guarantees the 4-byte read; the features are enabled.
        unsafe {
            std::arch::asm!(
                "vpdpwssd {acc}, {a}, dword ptr [{b} + {i} * 4]{{1to16}}",
                acc = inout(zmm_reg) acc,
                a = in(zmm_reg) a,
                b = in(reg) b,
                i = in(reg) i,
                options(pure, readonly, nostack, preserves_flags)
            );
        }
        acc
    }

    /// Sum of the 16 lanes in the order of [`reduce16`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce_add(v: __m512) -> f32 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let a = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
        let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
        _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)))
    }

    /// The maximum of each of up to 16 registers (exact, so it equals one
    /// `_mm512_reduce_max_ps` per register), sharing the shuffles.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce_max_rows<const T: usize>(v: [__m512; T]) -> [f32; T] {
        debug_assert!(T <= 16);
        if T > 8 {
            return split_max_rows::<T, 8>(v);
        }
        if T > 4 {
            return split_max_rows::<T, 4>(v);
        }
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let r = |i: usize| if i < T { v[i] } else { ninf };
        // 128-bit blocks [a0 a1 a2 a3] of a and b -> max(a0, a2), max(a1, a3), same for b.
        let half = |a: __m512, b: __m512| {
            _mm512_max_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        };
        let (t01, t23) = (half(r(0), r(1)), half(r(2), r(3)));
        // Block i now holds row i's maximum over 4 lanes.
        let u = _mm512_max_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(t01, t23),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(t01, t23),
        );
        let u = _mm512_max_ps(u, _mm512_permute_ps::<0b01_00_11_10>(u));
        let u = _mm512_max_ps(u, _mm512_permute_ps::<0b10_11_00_01>(u));
        let mut out = [0f32; 16];
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), u) };
        std::array::from_fn(|t| out[4 * t])
    }

    /// [`reduce_max_rows`] of `T <= 2 H` registers as two of `H` (the second
    /// padded with `-inf`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn split_max_rows<const T: usize, const H: usize>(v: [__m512; T]) -> [f32; T] {
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let a = reduce_max_rows::<H>(std::array::from_fn(|i| v[i]));
        let b = reduce_max_rows::<H>(std::array::from_fn(
            |i| if H + i < T { v[H + i] } else { ninf },
        ));
        std::array::from_fn(|t| if t < H { a[t] } else { b[t - H] })
    }

    /// `T` rows at a time (`NC = hd / 16` output registers per row); every row's
    /// instructions are the same whatever `T` and its tile mates are.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub(super) unsafe fn chunk<const T: usize, const NC: usize>(
        src: &Src,
        rows: &Rows,
        pages: std::ops::Range<usize>,
        st: &mut State,
    ) {
        let r = rows.nk.len();
        let mut i = 0;
        while i < r {
            i += match r - i {
                1 => tile::<1, NC>(src, rows, pages.clone(), st, i),
                2 => tile::<2, NC>(src, rows, pages.clone(), st, i),
                3 if T >= 3 => tile::<3, NC>(src, rows, pages.clone(), st, i),
                4..=7 if T >= 8 => tile::<4, NC>(src, rows, pages.clone(), st, i),
                8..=15 if T >= 16 => tile::<8, NC>(src, rows, pages.clone(), st, i),
                _ => tile::<T, NC>(src, rows, pages.clone(), st, i),
            };
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn tile<const T: usize, const NC: usize>(
        src: &Src,
        rows: &Rows,
        pages: std::ops::Range<usize>,
        st: &mut State,
        i0: usize,
    ) -> usize {
        const GP: usize = GROUP_PAGES;
        let geo = src.geo;
        let (ps, hd) = (geo.ps, geo.hd);
        debug_assert_eq!(hd, NC * 16);
        let lanes: __mmask16 = ((1u32 << ps) - 1) as u16;
        let qq: [*const i32; T] =
            std::array::from_fn(|t| rows.qq[(i0 + t) * hd..].as_ptr().cast::<i32>());
        let lo: [usize; T] = std::array::from_fn(|t| rows.lo[i0 + t]);
        let nk: [usize; T] = std::array::from_fn(|t| rows.nk[i0 + t]);
        let (lo_min, lo_max) = (lo.iter().copied().min(), lo.iter().copied().max());
        let (lo_min, lo_max) = (lo_min.unwrap_or(0), lo_max.unwrap_or(0));
        let nk_min = nk.iter().copied().min().unwrap_or(0);
        let nk_max = nk.iter().copied().max().unwrap_or(0);
        let dq: [__m512; T] = std::array::from_fn(|t| _mm512_set1_ps(rows.dq[i0 + t]));
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        // A chunk starts from the empty state (m = -inf, l = 0, o = 0).
        let mut m = [f32::NEG_INFINITY; T];
        let mut lv = [_mm512_setzero_ps(); T];
        let mut o = [[_mm512_setzero_ps(); NC]; T];
        // The groups from the first holding a key of some row of the tile.
        let (mut b0, end) = row_pages(lo_min, nk_max, ps, &pages).unwrap_or((0, 0));
        while b0 < end {
            let b1 = (b0 + GP).min(end);
            let npg = b1 - b0;
            // Per row and page: the mask of the row's slots (0: none, a page
            // outside its keys). Plain loops, not `from_fn` closures: a closure
            // does not inherit the target features, so it was not inlined (a
            // call per entry).
            let mut valid = [[0 as __mmask16; GP]; T];
            let mut span = [[(0usize, 0usize); GP]; T];
            let mut has = [false; T];
            // Pages of the group that some row of the tile reads (only these
            // are tag-checked; without a window they are a prefix).
            let mut read = [false; GP];
            if b0 * ps >= lo_max && b1 * ps <= nk_min {
                // Every page whole for every row (most groups): the values
                // below, without their per-entry arithmetic.
                for t in 0..T {
                    for gi in 0..npg {
                        span[t][gi] = (0, ps);
                        valid[t][gi] = lanes;
                    }
                    has[t] = true;
                }
                read[..npg].fill(true);
            } else {
                for t in 0..T {
                    for gi in 0..npg {
                        let (j0, j1) = own_slots(lo[t], nk[t], b0 + gi, ps);
                        if j0 < j1 {
                            span[t][gi] = (j0, j1);
                            valid[t][gi] = (((1u32 << j1) - 1) & !((1u32 << j0) - 1)) as u16;
                            has[t] = true;
                            read[gi] = true;
                        }
                    }
                }
            }
            if !read.contains(&true) {
                // A gap between the windows of rows far apart.
                b0 = b1;
                continue;
            }
            let mut hb = [std::ptr::null::<u8>(); GP];
            let mut s = [[neg_inf; GP]; T];
            let mut dv = [_mm512_setzero_ps(); GP];
            for gi in 0..npg {
                if !read[gi] {
                    continue;
                }
                // SAFETY: `Src::at` checked that the head block [at, at + head_bytes)
                // is inside the pool; every load below stays inside it (masked to
                // `ps` slots, V quads below slots4 / 4).
                hb[gi] = unsafe { src.data.as_ptr().add(src.at(b0 + gi)) };
                // Scores: 16 slots per register, 2 dimensions per vpdpwssd lane.
                // Below 16 rows, two accumulators per row (even and odd pairs)
                // halve the dependent chains; from 16 rows on, 16 chains already
                // hide the latency and 32 accumulators would not fit the
                // registers (integer sums: the same result either way).
                let chains = if T >= 16 { 1 } else { 2 };
                let mut acc = [[_mm512_setzero_si512(); 2]; T];
                // Finished segments' scores (see `SCORE_SEGMENT`).
                let mut done = [_mm512_setzero_ps(); T];
                let mut kp = hb[gi];
                // The next page's K, one line per load here, so it is in L1
                // when its turn comes (the head blocks of consecutive pages are
                // a page stride apart: the hardware prefetchers restart).
                // Only a page some row reads (the next group's first page is
                // looked up once per group).
                let nb = b0 + gi + 1;
                let next = if gi + 1 < npg {
                    read[gi + 1]
                } else {
                    nb < end && some_row_reads(&lo, &nk, nb, ps)
                };
                let mut np = if next {
                    src.data.as_ptr().wrapping_add(src.at(nb))
                } else {
                    std::ptr::null()
                };
                for pair in (0..hd / 2).step_by(2) {
                    if pair > 0 && pair % SEGMENT_PAIRS == 0 {
                        for t in 0..T {
                            let seg = _mm512_add_epi32(acc[t][0], acc[t][1]);
                            done[t] = _mm512_add_ps(done[t], _mm512_cvtepi32_ps(seg));
                            acc[t] = [_mm512_setzero_si512(); 2];
                        }
                    }
                    if !np.is_null() {
                        _mm_prefetch::<_MM_HINT_T0>(np.cast());
                        _mm_prefetch::<_MM_HINT_T0>(np.wrapping_add(64).cast());
                        np = np.wrapping_add(2 * ps * 4);
                    }
                    // SAFETY: see `hb`; rows have hd query values (hd / 2 pairs,
                    // an even count since hd is a multiple of 16 here).
                    let k: [__m512i; 2] = std::array::from_fn(|j| unsafe {
                        _mm512_maskz_loadu_epi32(lanes, kp.add(j * ps * 4).cast())
                    });
                    for t in 0..T {
                        for (j, &kj) in k.iter().enumerate() {
                            let a = j % chains;
                            // SAFETY: pair + j < hd / 2 pairs of row t.
                            acc[t][a] = unsafe { dpwssd_bcst(acc[t][a], kj, qq[t], pair + j) };
                        }
                    }
                    kp = kp.wrapping_add(2 * ps * 4);
                }
                // SAFETY: see `hb`.
                let dk = unsafe { _mm512_maskz_loadu_ps(lanes, hb[gi].add(geo.k_scale).cast()) };
                dv[gi] = unsafe { _mm512_maskz_loadu_ps(lanes, hb[gi].add(geo.v_scale).cast()) };
                for t in 0..T {
                    let x = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[t][0], acc[t][1]));
                    let x = _mm512_add_ps(done[t], x);
                    let x = _mm512_mul_ps(x, _mm512_mul_ps(dq[t], dk));
                    s[t][gi] = _mm512_mask_blend_ps(valid[t][gi], neg_inf, x);
                }
            }
            // 16-bit weights as low bytes (0..16) and high bytes (16..32): two
            // integer passes.
            let mut u = [[[0u8; 32]; GP]; T];
            let mut sc = [[0f32; GP]; T];
            // Maxima of all rows of the tile in one reduction (exact: the same
            // values as one reduction per row).
            let mx: [__m512; T] = std::array::from_fn(|t| {
                s[t][1..npg]
                    .iter()
                    .fold(s[t][0], |a, &b| _mm512_max_ps(a, b))
            });
            // (Pages no row reads hold -inf scores and zero V scales: their
            // probabilities and weights below are 0, as for masked slots.)
            let mp = reduce_max_rows(mx);
            let m_new: [f32; T] = std::array::from_fn(|t| m[t].max(mp[t]));
            // alpha = 2^(m - m') for every row in one evaluation (lane t).
            let mut d = [0f32; 16];
            for t in 0..T {
                d[t] = m[t] - m_new[t];
            }
            // SAFETY: 16 floats.
            let e = exp2_ps(unsafe { _mm512_loadu_ps(d.as_ptr()) });
            let mut alpha = [0f32; 16];
            // SAFETY: 16 floats.
            unsafe { _mm512_storeu_ps(alpha.as_mut_ptr(), e) };
            let mut psum = [_mm512_setzero_ps(); T];
            for gi in 0..npg {
                let w: [__m512; T] = std::array::from_fn(|t| {
                    let p = exp2_ps(_mm512_sub_ps(s[t][gi], _mm512_set1_ps(m_new[t])));
                    psum[t] = _mm512_add_ps(psum[t], p);
                    // Probabilities times V scales, as 16-bit fractions of the
                    // page's maximum.
                    _mm512_maskz_mul_ps(valid[t][gi], p, dv[gi])
                });
                let wmax = reduce_max_rows(w);
                // Every row's `wmax / W_MAX` and `W_MAX / wmax` in two vector
                // divisions: the same correctly rounded quotients as scalar ones,
                // without 2 T serial `divss` per page.
                let mut wm = [1f32; 16];
                wm[..T].copy_from_slice(&wmax);
                // SAFETY: 16 floats.
                let wmv = unsafe { _mm512_loadu_ps(wm.as_ptr()) };
                let (mut scale, mut inv) = ([0f32; 16], [0f32; 16]);
                // SAFETY: 16 floats each.
                unsafe {
                    _mm512_storeu_ps(
                        scale.as_mut_ptr(),
                        _mm512_div_ps(wmv, _mm512_set1_ps(W_MAX)),
                    );
                    _mm512_storeu_ps(inv.as_mut_ptr(), _mm512_div_ps(_mm512_set1_ps(W_MAX), wmv));
                }
                for t in 0..T {
                    if valid[t][gi] == 0 || wmax[t].is_nan() || wmax[t] <= 0.0 {
                        continue;
                    }
                    sc[t][gi] = scale[t];
                    let q = _mm512_cvtps_epi32(_mm512_mul_ps(w[t], _mm512_set1_ps(inv[t])));
                    let q = _mm512_min_epi32(q, _mm512_set1_epi32(W_MAX as i32));
                    // Lane j is [lo, hi, 0, 0]: gather the low bytes into dword 0
                    // and the high bytes into dword 1 of each 128-bit block, then
                    // those dwords in order (one shuffle and one store instead
                    // of two `vpmovdb` stores, slow on Zen 4).
                    let b = _mm512_shuffle_epi8(q, BYTES_LO_HI);
                    let b = _mm512_permutexvar_epi32(DWORDS_LO_HI, b);
                    // SAFETY: 32 bytes into a 32-byte array.
                    unsafe {
                        _mm256_storeu_si256(u[t][gi].as_mut_ptr().cast(), _mm512_castsi512_si256(b))
                    };
                }
            }
            // A row without keys in the group keeps its state.
            for t in 0..T {
                if has[t] {
                    lv[t] = _mm512_fmadd_ps(lv[t], _mm512_set1_ps(alpha[t]), psum[t]);
                    m[t] = m_new[t];
                }
            }
            // Values: 4 slots per vpdpbusd lane, 16 dimensions per register; each
            // page's integer sums scaled by its own weight scale.
            for t in 0..T {
                if has[t] {
                    let a = _mm512_set1_ps(alpha[t]);
                    o[t] = o[t].map(|x| _mm512_mul_ps(x, a));
                }
            }
            // Rows outer, slots inner: R rows' 2 x NC integer sums stay in
            // registers (all rows' sums at once spilled), and each V load serves
            // R rows. A row visits the quads of its mate's keys too: its weights
            // there are 0, so its integer sums are the same.
            macro_rules! pv {
                ($r:expr, $t0:expr, $gi:expr, $v0:expr) => {{
                    let rows: [usize; $r] = std::array::from_fn(|k| $t0 + k);
                    // A plain loop: a closure returning the pair was not inlined.
                    let mut sp = [(0usize, 0usize); $r];
                    for (k, s) in sp.iter_mut().enumerate() {
                        *s = span[$t0 + k][$gi];
                    }
                    let out = pv_rows::<$r, NC>(
                        $v0,
                        hd,
                        rows.map(|t| &u[t][$gi]),
                        sp,
                        rows.map(|t| sc[t][$gi]),
                        rows.map(|t| o[t]),
                    );
                    for (k, ot) in out.into_iter().enumerate() {
                        o[$t0 + k] = ot;
                    }
                    $r
                }};
            }
            for gi in 0..npg {
                if !read[gi] {
                    continue;
                }
                let v0 = hb[gi].wrapping_add(geo.v_off);
                let mut t0 = 0;
                while t0 < T {
                    // Two rows per V load where their 4 x NC sums fit the
                    // registers (three rows measured no faster). `v0` is the V
                    // block of a head block inside the pool (see `hb`).
                    t0 += match (NC, T - t0) {
                        (..=4, 2..) => pv!(2, t0, gi, v0),
                        _ => pv!(1, t0, gi, v0),
                    };
                }
            }
            b0 = b1;
        }
        for t in 0..T {
            st.m[i0 + t] = m[t];
            st.l[i0 + t] = reduce_add(lv[t]);
            for (c, &oc) in o[t].iter().enumerate() {
                // SAFETY: row i0 + t has hd = NC * 16 outputs.
                unsafe { _mm512_storeu_ps(st.o[(i0 + t) * hd + c * 16..].as_mut_ptr(), oc) };
            }
        }
        T
    }

    /// Whether some row of a tile (keys `lo[t]..nk[t]`) has keys in page `b`.
    #[inline(always)]
    fn some_row_reads<const T: usize>(
        lo: &[usize; T],
        nk: &[usize; T],
        b: usize,
        ps: usize,
    ) -> bool {
        (0..T).any(|t| {
            let (j0, j1) = own_slots(lo[t], nk[t], b, ps);
            j0 < j1
        })
    }

    /// `o[r] + sc[r] * sum_j (256 hi_j + lo_j) v_j` for `R` rows over the V block
    /// at `v0` (the page's `hd * 16` bytes, 4 slots per 32-bit lane); row `r`'s
    /// keys are slots `span[r].0..span[r].1`, and a row with none in the page is
    /// returned unchanged. The quads visited are those of the union of the rows'
    /// slots; a row's weights outside its keys are 0, so its integer sums do not
    /// depend on its mates.
    ///
    /// # Safety
    /// `v0` must point at the V bytes of a head block inside the pool.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn pv_rows<const R: usize, const NC: usize>(
        v0: *const u8,
        hd: usize,
        u: [&[u8; 32]; R],
        span: [(usize, usize); R],
        sc: [f32; R],
        mut o: [[__m512; NC]; R],
    ) -> [[__m512; NC]; R] {
        // Plain loops: closures do not inherit the target features (see `tile`).
        let (mut q0, mut q1) = (usize::MAX, 0);
        for &(j0, j1) in &span {
            if j0 < j1 {
                q0 = q0.min(j0 / 4);
                q1 = q1.max(j1.div_ceil(4));
            }
        }
        if q1 == 0 {
            return o;
        }
        let mut acc = [[_mm512_setzero_si512(); NC]; R];
        let mut acl = [[_mm512_setzero_si512(); NC]; R];
        let mut vp = v0.wrapping_add(q0 * hd * 4);
        for quad in q0..q1 {
            // SAFETY: q1 <= ceil(page_size / 4), the quads of hd * 4 bytes
            // the caller's V block holds (a span ends at most at the page size).
            let v: [__m512i; NC] =
                std::array::from_fn(|c| unsafe { _mm512_loadu_si512(vp.add(c * 64).cast()) });
            for r in 0..R {
                // SAFETY: quad < 4 (page size <= 16): low bytes at 0..16, high
                // bytes at 16..32 of the 32-byte arrays.
                let (h4, l4) = unsafe {
                    (
                        std::ptr::read_unaligned(u[r].as_ptr().cast::<i32>().add(4 + quad)),
                        std::ptr::read_unaligned(u[r].as_ptr().cast::<i32>().add(quad)),
                    )
                };
                let (h4, l4) = (_mm512_set1_epi32(h4), _mm512_set1_epi32(l4));
                for c in 0..NC {
                    acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], h4, v[c]);
                    acl[r][c] = _mm512_dpbusd_epi32(acl[r][c], l4, v[c]);
                }
            }
            vp = vp.wrapping_add(hd * 4);
        }
        for r in 0..R {
            if span[r].0 >= span[r].1 {
                continue;
            }
            let s = _mm512_set1_ps(sc[r]);
            for c in 0..NC {
                let a = _mm512_add_epi32(_mm512_slli_epi32::<8>(acc[r][c]), acl[r][c]);
                o[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s, o[r][c]);
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job<'a>(n_keys: &'a [usize], window: Option<usize>, out: &'a mut [f32]) -> AttnJob<'a> {
        AttnJob {
            q: &[],
            n_keys,
            table: &[],
            out,
            window,
        }
    }

    #[test]
    fn a_window_at_a_32k_context_plans_and_costs_like_its_keys() {
        // 16-key pages, 32 pages per chunk: a decode row at 32,768 keys.
        let mut out = [];
        let nk = [32768];
        let (chunks, cost) = block_plan(&job(&nk, None, &mut out), 0..1, 16, 32);
        assert_eq!((chunks, cost), (0..64, 32768 + 16));
        let (chunks, cost) = block_plan(&job(&nk, Some(512), &mut out), 0..1, 16, 32);
        assert_eq!((chunks, cost), (63..64, 512 + 16));
        // Window 520 starts in chunk 62; a window covering every key is `None`.
        let (chunks, cost) = block_plan(&job(&nk, Some(520), &mut out), 0..1, 16, 32);
        assert_eq!((chunks, cost), (62..64, 520 + 16));
        let wide = block_plan(&job(&nk, Some(40000), &mut out), 0..1, 16, 32);
        assert_eq!(wide, block_plan(&job(&nk, None, &mut out), 0..1, 16, 32));
        // A prefill block: each row's own window, short rows counted in full.
        let nk = [3, 1000, 1001, 1002];
        let (chunks, cost) = block_plan(&job(&nk, Some(100), &mut out), 1..4, 16, 32);
        assert_eq!((chunks, cost), (1..2, 300 + 48));
        let (chunks, cost) = block_plan(&job(&nk, Some(100), &mut out), 0..4, 16, 32);
        assert_eq!((chunks, cost), (0..2, 303 + 64));
    }

    #[test]
    fn the_blocks_read_are_the_union_of_the_rows_windows() {
        let mut out = [];
        // Rows at 300 and 1900 keys, window 100: keys 200..300 and 1800..1900.
        let j = job(&[1900, 300], Some(100), &mut out);
        assert_eq!(read_blocks(&j, 16), vec![12..19, 112..119]);
        // Consecutive prefill rows: one range; windows that touch merge.
        let nk: Vec<usize> = (33..=64).collect();
        assert_eq!(read_blocks(&job(&nk, Some(16), &mut out), 16), vec![1..4]);
        assert_eq!(
            read_blocks(&job(&[32, 48], Some(16), &mut out), 16),
            vec![1..3]
        );
        assert_eq!(read_blocks(&job(&nk, None, &mut out), 16), vec![0..4]);
        assert_eq!(read_blocks(&job(&[1], Some(1), &mut out), 16), vec![0..1]);
    }
}
