//! The CUDA kernels against the CPU ones and exact references, on a GPU.
//!
//! Without a CUDA device (no driver, no NVRTC, no cuBLAS, no GPU) every test says
//! why and passes, unless `TESSERA_REQUIRE_CUDA=1` (set by `scripts/gpu_check.sh`),
//! which makes that a failure. The paged-attention cases are the shared table of
//! `tests/common/attention_cases.rs`, which the CPU kernel also runs.
#![cfg(feature = "cuda")]

#[path = "common/attention_cases.rs"]
mod attention_cases;

use attention_cases::{cases, max_abs_error, Fault, Fixture, LAYER};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tessera_kernels::cuda::{AttentionLaunch, CudaDevice, DeviceKv, StepRow, StepSeq, StepTables};
use tessera_kernels::quant::{dequantize_block, QFormat};

/// Largest |GPU - exact| accepted: the device kernel reads the same 8-bit values
/// with f32 queries and f32 accumulation (errors ~1e-6 measured on the CPU side of
/// the arithmetic); a wrong key, scale or softmax is off by 1e-2 or more.
const GPU_TOL: f64 = 2e-4;

fn device() -> Option<CudaDevice> {
    match CudaDevice::open(0) {
        Ok(d) => {
            eprintln!("{:?}", d.info());
            Some(d)
        }
        Err(e) => {
            let required = std::env::var("TESSERA_REQUIRE_CUDA").is_ok_and(|v| v == "1");
            assert!(!required, "TESSERA_REQUIRE_CUDA=1 but no CUDA device: {e}");
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// The device pool of a fixture: its bytes and tags uploaded as they are.
fn upload_pool(dev: &CudaDevice, f: &Fixture) -> DeviceKv {
    let l = f.case.layout;
    let pages = f.tags.len();
    let mut kv = DeviceKv::new(dev, l, pages).unwrap();
    let pb = l.page_bytes();
    for p in 0..pages {
        kv.write_page(dev, p as u32, &f.data[p * pb..(p + 1) * pb])
            .unwrap();
    }
    let updates: Vec<(u32, _)> = f
        .tags
        .iter()
        .enumerate()
        .map(|(p, t)| (p as u32, *t))
        .collect();
    kv.write_tags(dev, &updates).unwrap();
    kv
}

fn step_seqs(f: &Fixture) -> Vec<StepSeq<'_>> {
    f.tables.iter().map(|t| StepSeq { table: t }).collect()
}

#[test]
fn gpu_attention_matches_the_reference_table() {
    let Some(dev) = device() else { return };
    for c in cases() {
        let f = Fixture::new(&c);
        let kv = upload_pool(&dev, &f);
        let row = c.n_heads * c.layout.head_dim;
        let mut rows = Vec::new();
        let mut q = Vec::new();
        for (s, sc) in c.seqs.iter().enumerate() {
            rows.extend(sc.rows.iter().map(|&nk| StepRow {
                slot: s as u32,
                pos: nk as u32 - 1,
            }));
            q.extend_from_slice(&f.q[s]);
        }
        let seqs = step_seqs(&f);
        let mut tables = StepTables::new(&dev, 0).unwrap();
        tables.set(&dev, &rows, &seqs).unwrap();
        let qd = dev.upload(&q).unwrap();
        let mut out = dev.upload(&vec![7f32; q.len()]).unwrap();
        for check_tags in [true, false] {
            if !check_tags && c.fault != Fault::None {
                continue; // with checks off a fault is not detected (benchmarks only)
            }
            dev.paged_attention(AttentionLaunch {
                q: &qd,
                q_stride: row,
                out: &mut out,
                out_stride: row,
                kv: &kv,
                tables: &tables,
                layer: LAYER,
                n_heads: c.n_heads,
                check_tags,
                window: None,
            })
            .unwrap();
            let got = dev.download(&out, q.len()).unwrap();
            let fails = tables.failures(&dev).unwrap();
            let mut at = 0;
            for (s, sc) in c.seqs.iter().enumerate() {
                let mine = &got[at..at + sc.rows.len() * row];
                at += mine.len();
                match f.expected(s) {
                    Ok(want) => {
                        assert_eq!(fails[s], None, "{}: sequence {s} failed", c.name);
                        let err = max_abs_error(c.name, s, mine, &want);
                        eprintln!("{}: sequence {s}: max |gpu - exact| {err:.2e}", c.name);
                        assert!(err < GPU_TOL, "{}: sequence {s} is off by {err}", c.name);
                    }
                    Err(block) => {
                        assert_eq!(fails[s], Some(block), "{}: sequence {s}", c.name);
                        assert!(mine.iter().all(|v| *v == 0.0), "{}: failed output", c.name);
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_attention_refuses_a_sliding_window_and_leaves_the_output_alone() {
    // The device kernel attends to every key; a window (Gemma's local layers)
    // must be refused, not silently ignored.
    let Some(dev) = device() else { return };
    let c = &cases()[0];
    let f = Fixture::new(c);
    let kv = upload_pool(&dev, &f);
    let row = c.n_heads * c.layout.head_dim;
    let rows: Vec<StepRow> = (0..c.seqs.len())
        .map(|s| StepRow {
            slot: s as u32,
            pos: c.seqs[s].keys as u32 - 1,
        })
        .collect();
    let seqs = step_seqs(&f);
    let mut tables = StepTables::new(&dev, 0).unwrap();
    tables.set(&dev, &rows, &seqs).unwrap();
    let qd = dev.upload(&vec![0.5f32; rows.len() * row]).unwrap();
    let mut out = dev.upload(&vec![7f32; rows.len() * row]).unwrap();
    let e = dev
        .paged_attention(AttentionLaunch {
            q: &qd,
            q_stride: row,
            out: &mut out,
            out_stride: row,
            kv: &kv,
            tables: &tables,
            layer: LAYER,
            n_heads: c.n_heads,
            check_tags: true,
            window: Some(512),
        })
        .unwrap_err();
    assert_eq!(e.label(), "shape");
    assert!(e.to_string().contains("sliding-window"), "{e}");
    let got = dev.download(&out, rows.len() * row).unwrap();
    assert!(got.iter().all(|v| *v == 7.0));
}

#[test]
fn gpu_kv_store_writes_the_cpu_page_bytes_and_refuses_foreign_pages() {
    let Some(dev) = device() else { return };
    for c in cases() {
        let f = Fixture::new(&c);
        let l = c.layout;
        let pb = l.page_bytes();
        let pages = f.tags.len();
        // Stale bytes everywhere, the fixture's tags, then every token through kv_store.
        let mut kv = DeviceKv::new(&dev, l, pages).unwrap();
        for p in 0..pages {
            kv.write_page(&dev, p as u32, &vec![c.stale; pb]).unwrap();
        }
        let updates: Vec<(u32, _)> = f
            .tags
            .iter()
            .enumerate()
            .map(|(p, t)| (p as u32, *t))
            .collect();
        kv.write_tags(&dev, &updates).unwrap();
        let seqs = step_seqs(&f);
        let kvd = l.kv_dim();
        let mut tables = StepTables::new(&dev, 0).unwrap();
        let mut rows = Vec::new();
        for (s, sc) in c.seqs.iter().enumerate() {
            rows.extend((0..sc.keys).map(|t| StepRow {
                slot: s as u32,
                pos: t as u32,
            }));
        }
        tables.set(&dev, &rows, &seqs).unwrap();
        for layer in 0..l.layers {
            let mut qkv = Vec::with_capacity(rows.len() * 2 * kvd);
            for r in &rows {
                let (k, v) = &f.kv[r.slot as usize][r.pos as usize][layer];
                qkv.extend_from_slice(k);
                qkv.extend_from_slice(v);
            }
            let qkv = dev.upload(&qkv).unwrap();
            dev.kv_store(&qkv, 2 * kvd, 0, kvd, &mut kv, &tables, layer, true)
                .unwrap();
        }
        let fails = tables.failures(&dev).unwrap();
        let want_fail: Vec<Option<u32>> = (0..c.seqs.len()).map(|s| f.expected(s).err()).collect();
        assert_eq!(fails, want_fail, "{}", c.name);
        for p in 0..pages {
            let got = kv.read_page(&dev, p as u32).unwrap();
            let want = &f.data[p * pb..(p + 1) * pb];
            // A sequence that failed stops writing (its own pages are left
            // partly written); every other page, the one it was pointed at
            // included, holds exactly the CPU's bytes.
            let victim = match c.fault {
                Fault::ForeignPage { seq, .. } | Fault::StaleEpoch { seq, .. } => {
                    f.tags[p].seq == attention_cases::tag(seq, 0).seq
                }
                Fault::None => false,
            };
            if !victim {
                assert!(
                    got == want,
                    "{}: page {p} bytes differ from the CPU's",
                    c.name
                );
            }
        }
    }
}

#[test]
fn gpu_page_checksums_equal_crc32c() {
    let Some(dev) = device() else { return };
    let c = &cases()[0];
    let f = Fixture::new(c);
    let kv = upload_pool(&dev, &f);
    let pb = c.layout.page_bytes();
    let pages: Vec<u32> = (0..f.tags.len() as u32).rev().collect();
    let got = kv.checksums(&dev, &pages).unwrap();
    for (p, crc) in pages.iter().zip(got) {
        let p = *p as usize;
        assert_eq!(
            crc,
            crc32c::crc32c(&f.data[p * pb..(p + 1) * pb]),
            "page {p}"
        );
    }
    // A page index outside the pool reads as 0, never out of bounds.
    assert_eq!(kv.checksums(&dev, &[u32::MAX]).unwrap(), vec![0]);
}

#[test]
fn gpu_tag_writes_and_checks() {
    let Some(dev) = device() else { return };
    let c = &cases()[0];
    let f = Fixture::new(c);
    let mut kv = upload_pool(&dev, &f);
    assert_eq!(kv.read_tags(&dev).unwrap(), f.tags);
    let e = f.tables[0][0];
    let pairs = [(e.page, e.tag), (f.tables[1][0].page, e.tag)];
    assert_eq!(kv.verify_tags(&dev, &pairs).unwrap(), vec![true, false]);
    let mut bumped = e.tag;
    bumped.epoch += 1;
    kv.write_tags(&dev, &[(e.page, bumped)]).unwrap();
    assert_eq!(kv.verify_tags(&dev, &pairs[..1]).unwrap(), vec![false]);
}

#[test]
fn gpu_dequantization_equals_the_cpu_blocks_rounded_to_bf16() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for format in [QFormat::Q4_0, QFormat::Q4_1, QFormat::Q8_0] {
        let n_blocks = 1000;
        let bb = format.block_bytes();
        let mut bytes: Vec<u8> = (0..n_blocks * bb).map(|_| rng.random()).collect();
        for b in 0..n_blocks {
            // Finite f16 scales (random bytes could be NaN or infinite).
            let d = half::f16::from_f32(rng.random_range(-0.1..0.1)).to_le_bytes();
            bytes[b * bb..b * bb + 2].copy_from_slice(&d);
            if format == QFormat::Q4_1 {
                let m = half::f16::from_f32(rng.random_range(-1.0..1.0)).to_le_bytes();
                bytes[b * bb + 2..b * bb + 4].copy_from_slice(&m);
            }
        }
        let dev_blocks = dev.upload(&bytes).unwrap();
        let mut out = dev.zeros::<u16>(n_blocks * 32).unwrap();
        dev.dequantize(format, &dev_blocks, n_blocks, &mut out, 0)
            .unwrap();
        let got = dev.download(&out, n_blocks * 32).unwrap();
        let mut want = vec![0f32; 32];
        for b in 0..n_blocks {
            dequantize_block(format, &bytes[b * bb..(b + 1) * bb], &mut want);
            for j in 0..32 {
                assert_eq!(
                    got[b * 32 + j],
                    bf16::from_f32(want[j]).to_bits(),
                    "{} block {b} value {j}",
                    format.name()
                );
            }
        }
    }
}

#[test]
fn gpu_elementwise_ops_match_the_cpu_ops() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let (n, d) = (5, 576);
    let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-3.0..3.0)).collect();
    let w: Vec<f32> = (0..d).map(|_| rng.random_range(0.5..1.5)).collect();
    // RMSNorm, f32 and bf16 outputs, with a row gather.
    let mut want = vec![0f32; n * d];
    tessera_kernels::ops::rms_norm(&x, &w, 1e-5, &mut want);
    let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
    let mut of = dev.zeros::<f32>(n * d).unwrap();
    let mut ob = dev.zeros::<u16>(n * d).unwrap();
    dev.rms_norm(&xd, &wd, 1e-5, d, n, None, Some(&mut of), Some(&mut ob))
        .unwrap();
    let (gf, gb) = (
        dev.download(&of, n * d).unwrap(),
        dev.download(&ob, n * d).unwrap(),
    );
    for i in 0..n * d {
        assert!(
            (gf[i] - want[i]).abs() <= 1e-5 * want[i].abs().max(1.0),
            "rms_norm {i}"
        );
        assert_eq!(gb[i], bf16::from_f32(gf[i]).to_bits(), "rms_norm bf16 {i}");
    }
    let rows = dev.upload(&[3u32, 0]).unwrap();
    let mut og = dev.zeros::<f32>(2 * d).unwrap();
    dev.rms_norm(&xd, &wd, 1e-5, d, 2, Some(&rows), Some(&mut og), None)
        .unwrap();
    let gg = dev.download(&og, 2 * d).unwrap();
    assert_eq!(&gg[..d], &gf[3 * d..4 * d]);
    assert_eq!(&gg[d..], &gf[..d]);
    // RoPE on the K part of a qkv-like row (columns 576.. of 960), positions 0..n.
    let (hd, heads, stride, col0) = (64, 3, 960, 576);
    let rope = tessera_kernels::ops::Rope::new(hd, 100_000.0);
    let qkv: Vec<f32> = (0..n * stride)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let pos: Vec<u32> = vec![0, 1, 17, 4095, 8191];
    let mut want = qkv.clone();
    for (r, &p) in pos.iter().enumerate() {
        rope.apply(
            &mut want[r * stride + col0..r * stride + col0 + heads * hd],
            p as usize,
        );
    }
    let mut qd = dev.upload(&qkv).unwrap();
    let (pd, fd) = (
        dev.upload(&pos).unwrap(),
        dev.upload(rope.inv_freq()).unwrap(),
    );
    dev.rope(&mut qd, stride, col0, heads, hd, n, &pd.as_view(), &fd)
        .unwrap();
    let got = dev.download(&qd, n * stride).unwrap();
    for i in 0..n * stride {
        // sincosf vs Rust's sin_cos: a few ulps of the angle at position 8191.
        assert!(
            (got[i] - want[i]).abs() <= 2e-5 * want[i].abs().max(1.0),
            "rope {i}: {} vs {}",
            got[i],
            want[i]
        );
    }
    // SwiGLU.
    let ffn = 1536;
    let gu: Vec<f32> = (0..n * 2 * ffn)
        .map(|_| rng.random_range(-8.0..8.0))
        .collect();
    let mut want = vec![0f32; n * ffn];
    tessera_kernels::ops::swiglu_rows(&gu, ffn, &mut want);
    let gud = dev.upload(&gu).unwrap();
    let mut of = dev.zeros::<f32>(n * ffn).unwrap();
    dev.swiglu(&gud, ffn, n, Some(&mut of), None).unwrap();
    let got = dev.download(&of, n * ffn).unwrap();
    for i in 0..n * ffn {
        assert!(
            (got[i] - want[i]).abs() <= 1e-6 * want[i].abs().max(1.0),
            "swiglu {i}"
        );
    }
    // bf16 conversion, argmax (ties to the lowest index, NaN skipped).
    let v: Vec<f32> = vec![1.0, 3.5, f32::NAN, 3.5, -1e30, 1.000_000_1, 65504.0, 3.0e38];
    let vd = dev.upload(&v).unwrap();
    let mut b = dev.zeros::<u16>(v.len()).unwrap();
    dev.to_bf16(&vd, v.len(), &mut b).unwrap();
    let got = dev.download(&b, v.len()).unwrap();
    for (g, x) in got.iter().zip(&v) {
        let want = bf16::from_f32(*x);
        assert!(
            *g == want.to_bits() || (x.is_nan() && bf16::from_bits(*g).is_nan()),
            "{x}"
        );
    }
    let logits = vec![
        1.0,
        3.5,
        f32::NAN,
        3.5, // row 0: first 3.5 wins
        f32::NAN,
        f32::NAN,
        f32::NAN,
        f32::NAN, // row 1: all NaN -> vocab
        -5.0,
        -4.0,
        -4.0,
        -6.0, // row 2
    ];
    let ld = dev.upload(&logits).unwrap();
    let mut am = dev.zeros::<u32>(3).unwrap();
    dev.argmax_rows(&ld, 4, 3, &mut am).unwrap();
    assert_eq!(dev.download(&am, 3).unwrap(), vec![1, 4, 1]);
}

#[test]
fn gpu_gemm_matches_an_f64_reference_on_bf16_inputs() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    for (n, out_f, k) in [(1, 960, 576), (37, 3072, 576), (256, 576, 1536)] {
        let w: Vec<u16> = (0..out_f * k)
            .map(|_| bf16::from_f32(rng.random_range(-0.1..0.1)).to_bits())
            .collect();
        let x: Vec<u16> = (0..n * k)
            .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)).to_bits())
            .collect();
        let y0: Vec<f32> = (0..n * out_f)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let (wd, xd) = (dev.upload(&w).unwrap(), dev.upload(&x).unwrap());
        for accumulate in [false, true] {
            let mut yd = dev.upload(&y0).unwrap();
            dev.gemm_bf16(&wd, out_f, k, &xd, n, &mut yd, accumulate)
                .unwrap();
            let got = dev.download(&yd, n * out_f).unwrap();
            let (mut num, mut den) = (0f64, 0f64);
            for r in 0..n {
                for o in 0..out_f {
                    let mut want: f64 = (0..k)
                        .map(|i| {
                            bf16::from_bits(w[o * k + i]).to_f64()
                                * bf16::from_bits(x[r * k + i]).to_f64()
                        })
                        .sum();
                    if accumulate {
                        want += y0[r * out_f + o] as f64;
                    }
                    num += (got[r * out_f + o] as f64 - want).powi(2);
                    den += want * want;
                }
            }
            let rel = (num / den).sqrt();
            assert!(
                rel < 1e-5,
                "gemm [{n}, {k}] x [{out_f}, {k}]^T: relative error {rel}"
            );
        }
    }
}
