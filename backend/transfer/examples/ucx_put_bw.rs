//! Put bandwidth of the `ucx` KV transport between two processes on this machine,
//! to set beside `ucx_perftest -t ucp_put_bw` on the same transport (docs/benchmarks.md,
//! "KV transfer: UCX put bandwidth").
//!
//! ```text
//! UCX_TLS=sm,self cargo run --release -p tessera-transfer --example ucx_put_bw
//! UCX_TLS=tcp     cargo run --release -p tessera-transfer --example ucx_put_bw -- --runs 3
//! ```
//!
//! Options (all optional): `--page-bytes N` (288000: one page of the default model),
//! `--total-bytes N` (1 GiB per run), `--pages N` (pages in the source buffer and the
//! sink region, cycled; 64), `--flush-every K` (flush after every K puts; 0 = only
//! at the end), `--runs R` (3; the median is reported), `--sink-alloc heap|ucx`
//! (`heap`: the sink registers ordinary memory, as a decode node's KV pool is today;
//! `ucx`: the sink lets UCX allocate the region, `UcxSink::allocate`).
//!
//! The process re-executes itself with `--sink` to serve the destination region (a
//! separate process, like a decode node), receives the descriptor on the child's
//! stdout, then times `put` of every page plus the final `flush` (remote
//! completion). Bandwidth is bytes / time in MiB/s (2^20 bytes per second): the
//! unit `ucx_perftest` prints as "MB/s".

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::ptr::NonNull;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tessera_kernels::PageTag;
use tessera_transfer::transport::{DestPage, KvTransport};
use tessera_transfer::ucx::{
    ucx_version, UcxContext, UcxRegionDescriptor, UcxSink, UcxSource, UcxSourceConfig,
};

struct Options {
    page_bytes: usize,
    total_bytes: usize,
    pages: usize,
    flush_every: usize,
    runs: usize,
    sink: bool,
    ucx_alloc: bool,
}

fn parse() -> Options {
    let mut o = Options {
        page_bytes: 288_000,
        total_bytes: 1 << 30,
        pages: 64,
        flush_every: 0,
        runs: 3,
        sink: false,
        ucx_alloc: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> usize {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} needs a number"))
        };
        match a.as_str() {
            "--page-bytes" => o.page_bytes = num("--page-bytes"),
            "--total-bytes" => o.total_bytes = num("--total-bytes"),
            "--pages" => o.pages = num("--pages"),
            "--flush-every" => o.flush_every = num("--flush-every"),
            "--runs" => o.runs = num("--runs"),
            "--sink" => o.sink = true,
            "--sink-alloc" => match args.next().as_deref() {
                Some("heap") => o.ucx_alloc = false,
                Some("ucx") => o.ucx_alloc = true,
                other => panic!("--sink-alloc heap|ucx, not {other:?}"),
            },
            other => panic!("unknown argument {other:?} (see the example's doc comment)"),
        }
    }
    assert!(o.page_bytes > 0 && o.pages > 0 && o.runs > 0);
    o
}

/// Child: serve `pages` pages, busy-progressing (like `ucx_perftest`'s responder)
/// until stdin closes.
fn sink(o: &Options) {
    let ctx = UcxContext::new().expect("UCX context");
    let len = o.pages * o.page_bytes;
    let mut buf = vec![0u8; if o.ucx_alloc { 0 } else { len }];
    let sink = if o.ucx_alloc {
        UcxSink::allocate(&ctx, len, o.page_bytes).expect("allocate")
    } else {
        let ptr = NonNull::new(buf.as_mut_ptr()).unwrap();
        // SAFETY: `buf` outlives the sink (dropped after it below) and is never read.
        unsafe { UcxSink::register(&ctx, ptr, len, o.page_bytes) }.expect("register")
    };
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "DESC {}",
        serde_json::to_string(sink.descriptor()).unwrap()
    )
    .unwrap();
    out.flush().unwrap();
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut line = String::new();
        while std::io::stdin()
            .read_line(&mut line)
            .map(|n| n > 0)
            .unwrap_or(false)
        {}
        let _ = tx.send(());
    });
    loop {
        for _ in 0..1024 {
            sink.progress();
        }
        if rx.try_recv().is_ok() {
            break;
        }
    }
    drop(sink);
    drop(buf);
}

fn main() {
    let o = parse();
    if o.sink {
        return sink(&o);
    }
    let ctx = match UcxContext::new() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--sink",
            "--pages",
            &o.pages.to_string(),
            "--page-bytes",
            &o.page_bytes.to_string(),
            "--sink-alloc",
            if o.ucx_alloc { "ucx" } else { "heap" },
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn sink");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let desc: UcxRegionDescriptor = loop {
        let line = lines.next().expect("sink exited").expect("sink stdout");
        if let Some(json) = line.strip_prefix("DESC ") {
            break serde_json::from_str(json).expect("descriptor");
        }
    };
    let mut src = UcxSource::connect(&ctx, &desc, UcxSourceConfig::default()).expect("connect");
    let source: Vec<u8> = (0..o.pages * o.page_bytes)
        .map(|i| (i * 31 + 7) as u8)
        .collect();
    let puts = o.total_bytes.div_ceil(o.page_bytes);
    let tag = PageTag::default();
    println!(
        "ucx_put_bw: UCX {} UCX_TLS={} UCX_NET_DEVICES={} peer_failure_detection={}",
        ucx_version().unwrap_or_default(),
        std::env::var("UCX_TLS").unwrap_or_else(|_| "(unset)".into()),
        std::env::var("UCX_NET_DEVICES").unwrap_or_else(|_| "(unset)".into()),
        src.peer_failure_detection()
    );
    println!(
        "  page {} B, {} pages cycled, {} puts = {} B per run, flush {}, sink memory {}",
        o.page_bytes,
        o.pages,
        puts,
        puts * o.page_bytes,
        if o.flush_every == 0 {
            "at end".to_owned()
        } else {
            format!("every {} puts", o.flush_every)
        },
        if o.ucx_alloc {
            "UCX-allocated"
        } else {
            "heap (registered)"
        }
    );
    // Warm-up: connection set-up and first touch of both regions.
    for p in 0..o.pages {
        let page = &source[p * o.page_bytes..(p + 1) * o.page_bytes];
        src.put(
            0,
            DestPage {
                page: p as u32,
                tag,
            },
            page,
        )
        .expect("put");
    }
    src.flush().expect("flush");

    let mut mbs = Vec::new();
    for run in 0..o.runs {
        let t0 = Instant::now();
        for i in 0..puts {
            let p = i % o.pages;
            let page = &source[p * o.page_bytes..(p + 1) * o.page_bytes];
            src.put(
                run as u64,
                DestPage {
                    page: p as u32,
                    tag,
                },
                page,
            )
            .expect("put");
            if o.flush_every > 0 && (i + 1) % o.flush_every == 0 {
                src.flush().expect("flush");
            }
        }
        src.flush().expect("flush");
        let dt = t0.elapsed();
        let rate = (puts * o.page_bytes) as f64 / dt.as_secs_f64() / (1u64 << 20) as f64;
        println!(
            "  run {}: {:.3} s, {:.1} MiB/s",
            run + 1,
            dt.as_secs_f64(),
            rate
        );
        mbs.push(rate);
    }
    mbs.sort_by(|a, b| a.total_cmp(b));
    println!(
        "median: {:.1} MiB/s over {} runs",
        mbs[mbs.len() / 2],
        o.runs
    );
    drop(src);
    drop(child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}
