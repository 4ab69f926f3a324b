//! The GPU checks of issue 16, item 5, as one program (`scripts/gpu_check.sh` runs
//! it on a lent GPU; see docs/benchmarks.md). Prints one JSON object per line and
//! appends them to `$OUT/gpu_check.jsonl` (or `--out DIR`); exits 1 when a check
//! fails, 2 when there is no usable CUDA device.
//!
//! 1. `device`: name, compute capability, driver, NVRTC, memory, the pool the
//!    default memory fraction (0.9 of free memory) would give, and a
//!    device-to-device copy's bandwidth (bytes read + written).
//! 2. `greedy`: for each prompt of `backend/model/tests/data/greedy_reference.json`, 32
//!    greedy tokens on the CPU (`Transformer::forward`) and on the GPU (`CudaLlama`);
//!    equal, or the first divergence at a near-tie: the CPU's margin between its
//!    token and the GPU's under [`NEAR_TIE`] (and the GPU's the other way too).
//! 3. `tag_mismatch`: four sequences decode one step; then the same step with a
//!    wrong tag planted in the device tag array of one sequence's page, and again
//!    with another sequence's block table pointed at a foreign page: exactly that
//!    sequence fails (an integrity error, no token) and the others' tokens equal
//!    the clean step's.
//! 4. `decode`: tokens/s at batch 1, 16, 64 and 256 (256-token prompts, then 96
//!    timed steps in four segments alternating tag checks on and off), with the
//!    batch-1 floor (bf16 weight bytes over the measured copy bandwidth).
//! 5. `prefill`: tokens/s of one 512-token and one 4,096-token prompt in one pass.

use serde_json::{json, Value};
use std::io::Write;
use std::time::Instant;
use tessera_kernels::attention::set_integrity_checks_for_benchmark;
use tessera_kernels::cuda::{pool_pages, CudaDevice};
use tessera_kernels::PageTag;
use tessera_model::cuda::{CudaLlama, CudaOptions, PoolSize};
use tessera_model::kv::{KvManager, PagePool, SeqId};
use tessera_model::sampling::argmax;
use tessera_model::testing::{greedy_with_logits, model_path};
use tessera_model::transformer::BatchRow;
use tessera_model::LoadedModel;

/// Largest top-2 margin (logit units) at which the CPU and the GPU may choose
/// differently: the CPU quantizes activations to 8 bits, the GPU rounds weights
/// to bf16 (8 significant bits), and either moves logits of this model by a few
/// tenths (the CPU against llama.cpp: up to ~1.0, accepted there at margins under
/// 0.25, backend/model/tests/llama_cpp_reference.rs).
const NEAR_TIE: f32 = 0.25;
/// Tokens per greedy case (as the reference).
const GREEDY_TOKENS: usize = 32;
/// Pages of the device pool used by the checks (1.6 GB for the default model):
/// enough for 256 sequences of 356 tokens.
const POOL_PAGES: usize = 8192;

struct Report {
    file: Option<std::fs::File>,
    ok: bool,
}

impl Report {
    fn line(&mut self, v: Value) {
        if v.get("ok") == Some(&Value::Bool(false)) {
            self.ok = false;
        }
        let s = v.to_string();
        println!("{s}");
        if let Some(f) = &mut self.file {
            let _ = writeln!(f, "{s}");
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let out_dir = arg("--out").or_else(|| std::env::var("OUT").ok());
    let file = out_dir.map(|d| {
        std::fs::create_dir_all(&d).expect("create the output directory");
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(std::path::Path::new(&d).join("gpu_check.jsonl"))
            .expect("open gpu_check.jsonl")
    });
    let mut rep = Report { file, ok: true };
    let path = arg("--model").map(Into::into).unwrap_or_else(model_path);
    if let Err(e) = run(&mut rep, &path) {
        rep.line(json!({"check": "error", "ok": false, "error": e}));
    }
    rep.line(json!({"check": "summary", "ok": rep.ok}));
    std::process::exit(if rep.ok { 0 } else { 1 });
}

fn run(rep: &mut Report, path: &std::path::Path) -> Result<(), String> {
    let t0 = Instant::now();
    let dev = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            rep.line(
                json!({"check": "device", "ok": false, "error": e.to_string(), "label": e.label()}),
            );
            std::process::exit(2);
        }
    };
    let compile_s = t0.elapsed().as_secs_f64();
    let (free0, total) = dev.mem_info().map_err(|e| e.to_string())?;
    let bandwidth = copy_bandwidth(&dev).map_err(|e| e.to_string())?;
    let cpu = LoadedModel::load(path).map_err(|e| e.to_string())?;
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let content =
        candle_core::quantized::gguf_file::Content::read(&mut f).map_err(|e| e.to_string())?;
    let info = dev.info().clone();
    let t1 = Instant::now();
    let opts = CudaOptions {
        pool: PoolSize::Pages(POOL_PAGES),
        ..CudaOptions::default()
    };
    let mut gpu = CudaLlama::load(&content, &mut f, dev, opts).map_err(|e| e.to_string())?;
    let load_s = t1.elapsed().as_secs_f64();
    let layout = gpu.config().kv_layout(16);
    let (free, _) = gpu.device().mem_info().map_err(|e| e.to_string())?;
    let fraction_pages =
        pool_pages(free + gpu.device_kv().bytes(), 0.9, &layout).map_err(|e| e.to_string())?;
    rep.line(json!({
        "check": "device", "ok": true,
        "name": info.name, "compute_capability": format!("{}.{}", info.compute_capability.0, info.compute_capability.1),
        "arch": info.arch, "driver_cuda_version": info.driver_version, "nvrtc": info.nvrtc,
        "total_bytes": total, "free_bytes_at_open": free0,
        "kernel_compile_s": compile_s, "model_load_s": load_s,
        "weight_bytes_bf16": gpu.weight_bytes(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "pool_pages_at_fraction_0_9": fraction_pages,
        "pool_tokens_at_fraction_0_9": fraction_pages * layout.page_size,
        "context": gpu.config().context,
        "i2_holds": fraction_pages * layout.page_size >= gpu.config().context,
    }));
    let mut kv = KvManager::new(PagePool::new(layout, gpu.kv_pages(), false));
    greedy_check(rep, &cpu, &mut gpu, &mut kv)?;
    mismatch_check(rep, &mut gpu, &mut kv)?;
    decode_bench(rep, &mut gpu, &mut kv, bandwidth)?;
    prefill_bench(rep, &mut gpu, &mut kv)?;
    Ok(())
}

/// Bytes read + written per second by a 1 GiB device-to-device copy (median of 5).
fn copy_bandwidth(dev: &CudaDevice) -> Result<f64, tessera_kernels::cuda::CudaError> {
    let n = 1usize << 30;
    let src = dev.upload(&vec![7u8; n])?;
    let mut dst = dev.zeros::<u8>(n)?;
    dev.copy_into(&src, n, &mut dst, 0)?;
    dev.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        dev.copy_into(&src, n, &mut dst, 0)?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * n as f64 / times[2])
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn reserve(kv: &mut KvManager, seq: u64, tokens: usize) -> Result<(), String> {
    kv.reserve(SeqId(seq), 1, tokens).map_err(|e| e.to_string())
}

/// Greedy tokens and their logits on the GPU for one prompt.
fn gpu_greedy(
    gpu: &mut CudaLlama,
    kv: &mut KvManager,
    prompt: &[u32],
    n: usize,
) -> Result<(Vec<u32>, Vec<Vec<f32>>), String> {
    let seq = 1;
    reserve(kv, seq, prompt.len() + n)?;
    let mut rows: Vec<BatchRow> = prompt
        .iter()
        .enumerate()
        .map(|(pos, &token)| BatchRow {
            seq: SeqId(seq),
            token,
            pos,
            want_logits: pos + 1 == prompt.len(),
        })
        .collect();
    let (mut out, mut all) = (Vec::new(), Vec::new());
    for step in 0..n {
        let fwd = gpu.forward(&rows, kv).map_err(|e| e.to_string())?;
        if !fwd.failed.is_empty() {
            kv.release(SeqId(seq));
            return Err(format!(
                "integrity failure in a clean run: {:?}",
                fwd.failed
            ));
        }
        let logits = fwd.logits.into_iter().next().ok_or("no logits")?.1;
        let tok = argmax(&logits);
        out.push(tok);
        all.push(logits);
        rows = vec![BatchRow {
            seq: SeqId(seq),
            token: tok,
            pos: prompt.len() + step,
            want_logits: true,
        }];
    }
    kv.release(SeqId(seq));
    Ok((out, all))
}

fn greedy_check(
    rep: &mut Report,
    cpu: &LoadedModel,
    gpu: &mut CudaLlama,
    kv: &mut KvManager,
) -> Result<(), String> {
    let reference: Value =
        serde_json::from_str(include_str!("../tests/data/greedy_reference.json"))
            .map_err(|e| e.to_string())?;
    for c in reference["cases"].as_array().ok_or("cases")? {
        let name = c["name"].as_str().unwrap_or("?");
        let prompt = ids(&c["prompt_ids"]);
        let (cpu_toks, cpu_logits) = greedy_with_logits(cpu, &prompt, GREEDY_TOKENS);
        let (gpu_toks, gpu_logits) = gpu_greedy(gpu, kv, &prompt, GREEDY_TOKENS)?;
        let first = (0..GREEDY_TOKENS).find(|&i| cpu_toks[i] != gpu_toks[i]);
        let agreed = first.unwrap_or(GREEDY_TOKENS);
        let max_diff = (0..agreed)
            .map(|i| {
                let t = cpu_toks[i] as usize;
                (cpu_logits[i][t] - gpu_logits[i][t]).abs()
            })
            .fold(0f32, f32::max);
        let (ok, divergence) = match first {
            None => (true, Value::Null),
            Some(i) => {
                let (ct, gt) = (cpu_toks[i] as usize, gpu_toks[i] as usize);
                let cpu_margin = cpu_logits[i][ct] - cpu_logits[i][gt];
                let gpu_margin = gpu_logits[i][gt] - gpu_logits[i][ct];
                (
                    cpu_margin < NEAR_TIE && gpu_margin < NEAR_TIE,
                    json!({"at": i, "cpu_token": ct, "gpu_token": gt, "cpu_margin": cpu_margin, "gpu_margin": gpu_margin}),
                )
            }
        };
        rep.line(json!({
            "check": "greedy", "case": name, "ok": ok, "equal_tokens": agreed,
            "of": GREEDY_TOKENS, "divergence": divergence,
            "max_top_logit_diff_while_equal": max_diff,
            "cpu": cpu_toks, "gpu": gpu_toks,
        }));
    }
    Ok(())
}

/// Prefills `prompts` (one sequence each, ids `first..`) in passes of at most 4,096
/// rows; returns each sequence's first greedy token.
fn prefill(
    gpu: &mut CudaLlama,
    kv: &mut KvManager,
    first: u64,
    prompts: &[Vec<u32>],
) -> Result<Vec<u32>, String> {
    let mut next = vec![0u32; prompts.len()];
    let mut rows = Vec::new();
    let mut owners = Vec::new();
    let flush = |gpu: &mut CudaLlama,
                 kv: &mut KvManager,
                 rows: &mut Vec<BatchRow>,
                 owners: &mut Vec<usize>,
                 next: &mut Vec<u32>|
     -> Result<(), String> {
        if rows.is_empty() {
            return Ok(());
        }
        let out = gpu.forward_greedy(rows, kv).map_err(|e| e.to_string())?;
        if !out.failed.is_empty() {
            return Err(format!(
                "integrity failure while prefilling: {:?}",
                out.failed
            ));
        }
        for (row, tok) in out.tokens {
            next[owners[row]] = tok;
        }
        rows.clear();
        owners.clear();
        Ok(())
    };
    for (i, p) in prompts.iter().enumerate() {
        if rows.len() + p.len() > 4096 {
            flush(gpu, kv, &mut rows, &mut owners, &mut next)?;
        }
        for (pos, &token) in p.iter().enumerate() {
            rows.push(BatchRow {
                seq: SeqId(first + i as u64),
                token,
                pos,
                want_logits: pos + 1 == p.len(),
            });
            owners.push(i);
        }
    }
    flush(gpu, kv, &mut rows, &mut owners, &mut next)?;
    Ok(next)
}

/// A seeded pseudo-random prompt of ordinary token ids.
fn prompt(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            200 + (x % 40_000) as u32
        })
        .collect()
}

fn decode_rows(first: u64, next: &[u32], pos: usize) -> Vec<BatchRow> {
    next.iter()
        .enumerate()
        .map(|(i, &token)| BatchRow {
            seq: SeqId(first + i as u64),
            token,
            pos,
            want_logits: true,
        })
        .collect()
}

fn mismatch_check(rep: &mut Report, gpu: &mut CudaLlama, kv: &mut KvManager) -> Result<(), String> {
    let (first, n, plen) = (2000u64, 4usize, 40usize);
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| prompt(i as u64 + 7, plen)).collect();
    for i in 0..n {
        reserve(kv, first + i as u64, plen + 8)?;
    }
    let next = prefill(gpu, kv, first, &prompts)?;
    let rows = decode_rows(first, &next, plen);
    let clean = gpu.forward_greedy(&rows, kv).map_err(|e| e.to_string())?;
    let mut results = Vec::new();
    // (a) A wrong tag in the device tag array on sequence 2's page (a stale or
    // foreign write on the device); (b) sequence 1's block table pointing at
    // sequence 3's page (a wrong mapping on the host).
    for (label, victim) in [("device_tag", 2usize), ("block_table", 1usize)] {
        let vseq = SeqId(first + victim as u64);
        let entry = kv.table(vseq).ok_or("table")?[0];
        let other = kv.table(SeqId(first + 3)).ok_or("table")?[0];
        match label {
            "device_tag" => gpu
                .plant_device_tag(
                    entry.page,
                    PageTag {
                        seq: 999_999,
                        ..entry.tag
                    },
                )
                .map_err(|e| e.to_string())?,
            _ => kv.table_mut_for_test(vseq).ok_or("table")?[0].page = other.page,
        }
        let out = gpu.forward_greedy(&rows, kv).map_err(|e| e.to_string());
        // Undo the fault before judging, so later checks run on a sound pool.
        match label {
            "device_tag" => gpu
                .plant_device_tag(entry.page, entry.tag)
                .map_err(|e| e.to_string())?,
            _ => kv.table_mut_for_test(vseq).ok_or("table")?[0].page = entry.page,
        }
        let out = out?;
        let failed: Vec<u64> = out.failed.keys().map(|s| s.0).collect();
        let others_equal = clean
            .tokens
            .iter()
            .filter(|(row, _)| *row != victim)
            .all(|t| out.tokens.contains(t));
        let victim_token = out.tokens.iter().any(|(row, _)| *row == victim);
        let ok =
            failed == vec![vseq.0] && others_equal && !victim_token && out.tokens.len() == n - 1;
        results.push(ok);
        rep.line(json!({
            "check": "tag_mismatch", "fault": label, "ok": ok, "victim": vseq.0,
            "failed": failed, "error": out.failed.values().map(|e| e.to_string()).collect::<Vec<_>>(),
            "others_tokens_equal_clean_step": others_equal, "victim_got_a_token": victim_token,
        }));
    }
    for i in 0..n {
        kv.release(SeqId(first + i as u64));
    }
    Ok(())
}

fn decode_bench(
    rep: &mut Report,
    gpu: &mut CudaLlama,
    kv: &mut KvManager,
    bandwidth: f64,
) -> Result<(), String> {
    let (plen, warm, seg, segs) = (256usize, 2usize, 24usize, 4usize);
    let first = 10_000u64;
    for batch in [1usize, 16, 64, 256] {
        let prompts: Vec<Vec<u32>> = (0..batch).map(|i| prompt(i as u64, plen)).collect();
        for i in 0..batch {
            reserve(kv, first + i as u64, plen + warm + seg * segs)?;
        }
        let mut next = prefill(gpu, kv, first, &prompts)?;
        let mut pos = plen;
        let step = |gpu: &mut CudaLlama,
                    kv: &mut KvManager,
                    next: &mut Vec<u32>,
                    pos: &mut usize|
         -> Result<(), String> {
            let out = gpu
                .forward_greedy(&decode_rows(first, next, *pos), kv)
                .map_err(|e| e.to_string())?;
            if !out.failed.is_empty() {
                return Err(format!(
                    "integrity failure while decoding: {:?}",
                    out.failed
                ));
            }
            for (row, tok) in out.tokens {
                next[row] = tok;
            }
            *pos += 1;
            Ok(())
        };
        for _ in 0..warm {
            step(gpu, kv, &mut next, &mut pos)?;
        }
        let (mut on, mut off) = (Vec::new(), Vec::new());
        for s in 0..segs {
            let checks = s % 2 == 0;
            set_integrity_checks_for_benchmark(checks);
            let t = Instant::now();
            for _ in 0..seg {
                step(gpu, kv, &mut next, &mut pos)?;
            }
            let tps = (batch * seg) as f64 / t.elapsed().as_secs_f64();
            if checks {
                on.push(tps)
            } else {
                off.push(tps)
            }
        }
        set_integrity_checks_for_benchmark(true);
        for i in 0..batch {
            kv.release(SeqId(first + i as u64));
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (on_tps, off_tps) = (mean(&on), mean(&off));
        let mut line = json!({
            "check": "decode", "batch": batch, "context": format!("{}..{}", plen + warm, pos),
            "tokens_per_s_checks_on": on_tps, "tokens_per_s_checks_off": off_tps,
            "step_ms_checks_on": 1e3 * batch as f64 / on_tps,
            "check_overhead_percent": 100.0 * (off_tps - on_tps) / off_tps,
            "segments_on": on, "segments_off": off,
        });
        if batch == 1 {
            line["floor_step_ms_weights_over_copy_bandwidth"] =
                json!(1e3 * gpu.weight_bytes() as f64 / bandwidth);
        }
        rep.line(line);
    }
    Ok(())
}

fn prefill_bench(rep: &mut Report, gpu: &mut CudaLlama, kv: &mut KvManager) -> Result<(), String> {
    for n in [512usize, 4096] {
        let p = prompt(n as u64, n);
        let mut times = Vec::new();
        for rep_i in 0..4 {
            let seq = 50_000 + rep_i as u64;
            reserve(kv, seq, n + 1)?;
            let t = Instant::now();
            prefill(gpu, kv, seq, std::slice::from_ref(&p))?;
            times.push(t.elapsed().as_secs_f64());
            kv.release(SeqId(seq));
        }
        let warm = times.remove(0);
        times.sort_by(f64::total_cmp);
        rep.line(json!({
            "check": "prefill", "tokens": n, "tokens_per_s": n as f64 / times[1],
            "median_s": times[1], "first_run_s": warm, "runs_s": times,
        }));
    }
    Ok(())
}
