//! The `ucx` KV transport against real UCX (no mocks): byte-exact page puts between
//! threads and between processes, bounds checks, and a dead peer turning into an
//! error rather than a hang.
//!
//! UCX picks its transport from the environment; `.ci/run` runs this file under
//! `UCX_TLS=sm,self` and `UCX_TLS=tcp`. Without libucx the tests print a skip line
//! and pass, unless `TESSERA_REQUIRE_UCX=1`, when they fail.
//!
//! The two-process tests re-execute this test binary: `ucx_child_sink` is a test that
//! does nothing unless `TESSERA_UCX_CHILD=sink`, in which case it serves a sink region
//! and talks to the parent over stdin/stdout.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tessera_kernels::PageTag;
use tessera_transfer::transport::{DestPage, KvTransport, TransportError};
use tessera_transfer::ucx::{
    ucx_version, UcxContext, UcxError, UcxRegionDescriptor, UcxSink, UcxSource, UcxSourceConfig,
};

/// Bytes per page of the default model: 30 layers x (K, V) x 16 slots x 192 x 2 bytes.
const PAGE: usize = 30 * 2 * 16 * 192 * 2;
/// Pages in the sink region.
const PAGES: usize = 64;
/// What untouched sink bytes hold.
const FILL: u8 = 0xA5;

/// A UCX context, or `None` (after a skip message) when libucx is missing and
/// `TESSERA_REQUIRE_UCX` is not `1`.
fn context_or_skip(test: &str) -> Option<UcxContext> {
    match UcxContext::new() {
        Ok(ctx) => {
            eprintln!(
                "{test}: UCX {} UCX_TLS={}",
                ucx_version().unwrap_or_default(),
                std::env::var("UCX_TLS").unwrap_or_else(|_| "(unset)".into())
            );
            Some(ctx)
        }
        Err(e) if e.is_unavailable() => {
            if std::env::var("TESSERA_REQUIRE_UCX").as_deref() == Ok("1") {
                panic!("TESSERA_REQUIRE_UCX=1 but UCX is unavailable: {e}");
            }
            eprintln!("SKIP {test}: {e}");
            None
        }
        Err(e) => panic!("UCX context: {e}"),
    }
}

fn dest(page: u32) -> DestPage {
    DestPage {
        page,
        tag: PageTag {
            tenant: 7,
            seq: 1,
            epoch: 0,
            logical_block: page,
        },
    }
}

/// Deterministic contents of source page `i`.
fn page_bytes(seed: u64, i: usize, out: &mut [u8]) {
    ChaCha8Rng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .fill_bytes(out);
}

fn crc_of(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

fn fill_crc() -> u32 {
    crc_of(&vec![FILL; PAGE])
}

/// Source page `i` goes to destination page `plan[i]`: 48 of the 64 pages, in a
/// scrambled order, so 16 pages stay untouched.
fn plan() -> Vec<u32> {
    (0..48u32).map(|i| (i * 37 + 5) % PAGES as u32).collect()
}

/// Puts every page of `plan` through one staging buffer that is overwritten right
/// after each put returns (checking that `put` is done with the source bytes), then
/// flushes. Returns the expected crc32c of every destination page.
fn put_plan(src: &mut UcxSource, seed: u64, plan: &[u32]) -> Vec<u32> {
    let mut expected = vec![fill_crc(); PAGES];
    let mut staging = vec![0u8; PAGE];
    for (i, &p) in plan.iter().enumerate() {
        page_bytes(seed, i, &mut staging);
        expected[p as usize] = crc_of(&staging);
        src.put(1, dest(p), &staging).expect("put");
        staging.fill(0x5A);
    }
    src.flush().expect("flush");
    expected
}

/// A sink region with one guard page on each side that is never registered.
struct GuardedRegion {
    buf: Vec<u8>,
}

impl GuardedRegion {
    fn new() -> Self {
        GuardedRegion {
            buf: vec![FILL; (PAGES + 2) * PAGE],
        }
    }
    fn region_ptr(&mut self) -> NonNull<u8> {
        NonNull::new(self.buf[PAGE..].as_mut_ptr()).unwrap()
    }
    /// crc32c of every region page, then whether both guards are untouched.
    fn crcs(&self) -> (Vec<u32>, bool) {
        let crcs = (0..PAGES)
            .map(|p| crc_of(&self.buf[(p + 1) * PAGE..(p + 2) * PAGE]))
            .collect();
        let guards = self.buf[..PAGE]
            .iter()
            .chain(&self.buf[(PAGES + 1) * PAGE..])
            .all(|&b| b == FILL);
        (crcs, guards)
    }
}

/// Runs a sink on its own thread (its own context, like a separate node), spinning
/// on `progress` until `stop`. Returns the descriptor and the thread.
fn spawn_sink(
    region: NonNull<u8>,
    stop: Arc<AtomicBool>,
) -> (UcxRegionDescriptor, std::thread::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let addr = region.as_ptr() as usize;
    let handle = std::thread::spawn(move || {
        let ctx = UcxContext::new().expect("sink context");
        let ptr = NonNull::new(addr as *mut u8).unwrap();
        // SAFETY: the region (PAGES pages inside a GuardedRegion) outlives this
        // thread, which the test joins before reading it.
        let sink = unsafe { UcxSink::register(&ctx, ptr, PAGES * PAGE, PAGE) }.expect("register");
        tx.send(sink.descriptor().clone()).unwrap();
        while !stop.load(Ordering::Acquire) {
            sink.progress();
        }
        // Let stragglers (close messages) through before the worker goes.
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(20) {
            sink.progress();
        }
    });
    (rx.recv().expect("sink descriptor"), handle)
}

#[test]
fn pages_put_from_another_thread_arrive_byte_exact() {
    let Some(ctx) = context_or_skip("pages_put_from_another_thread_arrive_byte_exact") else {
        return;
    };
    let mut region = GuardedRegion::new();
    let stop = Arc::new(AtomicBool::new(false));
    let (desc, sink) = spawn_sink(region.region_ptr(), stop.clone());
    assert_eq!(desc.pages(), PAGES as u64);
    assert_eq!(desc.page_bytes, PAGE as u64);
    // The descriptor is plain data: it survives the protocol's JSON encoding.
    let desc: UcxRegionDescriptor =
        serde_json::from_str(&serde_json::to_string(&desc).unwrap()).unwrap();

    let mut src = UcxSource::connect(&ctx, &desc, UcxSourceConfig::default()).expect("connect");
    let expected = put_plan(&mut src, 42, &plan());
    // A second round over the same pages with other bytes: later puts win.
    let expected2 = put_plan(&mut src, 43, &plan());
    assert_ne!(expected, expected2);
    drop(src);
    stop.store(true, Ordering::Release);
    sink.join().unwrap();

    let (crcs, guards) = region.crcs();
    assert!(guards, "a guard page outside the registered region changed");
    let untouched = (0..PAGES)
        .filter(|p| !plan().contains(&(*p as u32)))
        .count();
    assert_eq!(untouched, 16);
    for p in 0..PAGES {
        assert_eq!(crcs[p], expected2[p], "page {p}");
    }
}

#[test]
fn pages_put_into_a_ucx_allocated_region_arrive_byte_exact() {
    let Some(ctx) = context_or_skip("pages_put_into_a_ucx_allocated_region_arrive_byte_exact")
    else {
        return;
    };
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    // The sink owns its memory, so it reads the pages itself before it drops.
    let sink = std::thread::spawn(move || {
        let ctx = UcxContext::new().expect("sink context");
        let sink = UcxSink::allocate(&ctx, PAGES * PAGE, PAGE).expect("allocate");
        assert_eq!(sink.region().as_ptr() as u64, sink.descriptor().base);
        // SAFETY: nothing writes the region yet (the descriptor is not out).
        unsafe { std::ptr::write_bytes(sink.region().as_ptr(), FILL, PAGES * PAGE) };
        tx.send(sink.descriptor().clone()).unwrap();
        while !stop2.load(Ordering::Acquire) {
            sink.progress();
        }
        // SAFETY: the writer flushed and dropped its source before `stop`.
        let view = unsafe { std::slice::from_raw_parts(sink.region().as_ptr(), PAGES * PAGE) };
        view.chunks(PAGE).map(crc_of).collect::<Vec<u32>>()
    });
    let desc = rx.recv().expect("descriptor");
    let mut src = UcxSource::connect(&ctx, &desc, UcxSourceConfig::default()).expect("connect");
    let expected = put_plan(&mut src, 77, &plan());
    drop(src);
    stop.store(true, Ordering::Release);
    assert_eq!(sink.join().unwrap(), expected);
}

#[test]
fn two_sources_write_disjoint_pages_of_one_sink() {
    let Some(ctx) = context_or_skip("two_sources_write_disjoint_pages_of_one_sink") else {
        return;
    };
    let mut region = GuardedRegion::new();
    let stop = Arc::new(AtomicBool::new(false));
    let (desc, sink) = spawn_sink(region.region_ptr(), stop.clone());
    let writers: Vec<_> = (0..2u32)
        .map(|w| {
            let (ctx, desc) = (ctx.clone(), desc.clone());
            std::thread::spawn(move || {
                let mut src =
                    UcxSource::connect(&ctx, &desc, UcxSourceConfig::default()).expect("connect");
                let mut buf = vec![0u8; PAGE];
                let mut out = Vec::new();
                for p in (w..PAGES as u32).step_by(2) {
                    page_bytes(100 + u64::from(w), p as usize, &mut buf);
                    src.put(u64::from(w), dest(p), &buf).expect("put");
                    out.push((p as usize, crc_of(&buf)));
                }
                src.flush().expect("flush");
                out
            })
        })
        .collect();
    let mut expected = vec![0u32; PAGES];
    for w in writers {
        for (p, c) in w.join().unwrap() {
            expected[p] = c;
        }
    }
    stop.store(true, Ordering::Release);
    sink.join().unwrap();
    let (crcs, guards) = region.crcs();
    assert!(guards);
    assert_eq!(crcs, expected);
}

#[test]
fn out_of_bounds_puts_are_errors_and_write_nothing() {
    let Some(ctx) = context_or_skip("out_of_bounds_puts_are_errors_and_write_nothing") else {
        return;
    };
    let mut region = GuardedRegion::new();
    let stop = Arc::new(AtomicBool::new(false));
    let (desc, sink) = spawn_sink(region.region_ptr(), stop.clone());
    let mut src = UcxSource::connect(&ctx, &desc, UcxSourceConfig::default()).expect("connect");
    let page = vec![1u8; PAGE];
    let region_len = (PAGES * PAGE) as u64;

    assert_eq!(
        src.put(1, dest(PAGES as u32), &page),
        Err(TransportError::OutOfBounds {
            offset: region_len,
            len: PAGE as u64,
            region: region_len
        })
    );
    assert_eq!(
        src.put(1, dest(u32::MAX), &page),
        Err(TransportError::OutOfBounds {
            offset: u64::from(u32::MAX) * PAGE as u64,
            len: PAGE as u64,
            region: region_len
        })
    );
    // Longer than one page: would spill into the next page (someone else's).
    let long = vec![2u8; PAGE + 1];
    assert_eq!(
        src.put(1, dest(0), &long),
        Err(TransportError::OutOfBounds {
            offset: 0,
            len: PAGE as u64 + 1,
            region: PAGE as u64
        })
    );
    // The source is still usable after refused puts: the last page is writable.
    src.put(1, dest(PAGES as u32 - 1), &page)
        .expect("last page");
    src.flush().expect("flush");
    drop(src);
    stop.store(true, Ordering::Release);
    sink.join().unwrap();

    let (crcs, guards) = region.crcs();
    assert!(guards, "an out-of-bounds put reached a guard page");
    for (p, c) in crcs.iter().enumerate() {
        let want = if p == PAGES - 1 {
            crc_of(&page)
        } else {
            fill_crc()
        };
        assert_eq!(*c, want, "page {p}");
    }
}

#[test]
fn invalid_regions_and_descriptors_are_refused() {
    let Some(ctx) = context_or_skip("invalid_regions_and_descriptors_are_refused") else {
        return;
    };
    let mut buf = vec![0u8; 3 * PAGE];
    let ptr = NonNull::new(buf.as_mut_ptr()).unwrap();
    // SAFETY: not registered (refused before ucp_mem_map).
    let e = unsafe { UcxSink::register(&ctx, ptr, 3 * PAGE - 1, PAGE) }.unwrap_err();
    assert!(matches!(e, UcxError::InvalidRegion(_)), "{e}");
    let desc = UcxRegionDescriptor {
        worker_address: vec![],
        base: 0,
        len: 8,
        page_bytes: 8,
        rkey: vec![1],
    };
    let e = UcxSource::connect(&ctx, &desc, UcxSourceConfig::default()).unwrap_err();
    assert!(matches!(e, UcxError::InvalidRegion(_)), "{e}");
}

// ---- two processes ---------------------------------------------------------------

/// The child side: serves a sink of `PAGES` pages, prints `DESC <json>`, then
/// progresses (sleeping on the worker's event fd) until stdin says `crc` (prints
/// `CRC <json>` with every page's crc32c) or closes.
#[test]
fn ucx_child_sink() {
    if std::env::var("TESSERA_UCX_CHILD").as_deref() != Ok("sink") {
        return;
    }
    let ctx = UcxContext::new().expect("child context");
    let mut buf = vec![FILL; PAGES * PAGE];
    let ptr = NonNull::new(buf.as_mut_ptr()).unwrap();
    // SAFETY: `buf` outlives the sink (dropped at the end of this function, after
    // the sink); it is read only after the parent's flush and `crc` command.
    let sink = unsafe { UcxSink::register(&ctx, ptr, PAGES * PAGE, PAGE) }.expect("register");
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "DESC {}",
        serde_json::to_string(sink.descriptor()).unwrap()
    )
    .unwrap();
    out.flush().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    // Never outlive a parent that forgot us.
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline {
        sink.progress_wait(Duration::from_millis(5))
            .expect("progress");
        match rx.try_recv() {
            Ok(cmd) if cmd == "crc" => {
                // SAFETY: the parent flushed every put before sending `crc`.
                let view = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), PAGES * PAGE) };
                let crcs: Vec<u32> = view.chunks(PAGE).map(crc_of).collect();
                writeln!(out, "CRC {}", serde_json::to_string(&crcs).unwrap()).unwrap();
                out.flush().unwrap();
            }
            Ok(_) => {}
            Err(mpsc::TryRecvError::Empty) => {}
            Err(mpsc::TryRecvError::Disconnected) => break,
        }
    }
    drop(sink);
    drop(buf);
}

/// The parent's handle on a child sink process. Every wait on the child has a
/// deadline, and dropping the handle kills the child, so a broken child fails the
/// test instead of hanging it.
struct ChildSink {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

/// Longest wait for one line from the child.
const CHILD_TIMEOUT: Duration = Duration::from_secs(60);

impl ChildSink {
    fn spawn() -> (Self, UcxRegionDescriptor) {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "ucx_child_sink",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TESSERA_UCX_CHILD", "sink")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn child");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut me = ChildSink {
            child,
            stdin,
            lines,
        };
        let desc = serde_json::from_str(&me.expect("DESC ")).expect("descriptor json");
        (me, desc)
    }

    /// The rest of the first line that contains `tag` (libtest may print
    /// `test ucx_child_sink ... ` in front of it).
    fn expect(&mut self, tag: &str) -> String {
        let deadline = Instant::now() + CHILD_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(at) = line.find(tag) {
                        return line[at + tag.len()..].trim_end().to_owned();
                    }
                }
                Err(e) => {
                    panic!("no {tag:?} line from the child sink ({e:?}; see its stderr above)")
                }
            }
        }
    }

    fn crcs(&mut self) -> Vec<u32> {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "crc").unwrap();
        stdin.flush().unwrap();
        serde_json::from_str(&self.expect("CRC ")).expect("crc json")
    }

    /// Closes the child's stdin and waits (bounded) for a clean exit.
    fn finish(mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + CHILD_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "child sink exited with {status}");
                return;
            }
            assert!(Instant::now() < deadline, "child sink did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildSink {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[test]
fn pages_put_into_another_process_arrive_byte_exact() {
    let Some(ctx) = context_or_skip("pages_put_into_another_process_arrive_byte_exact") else {
        return;
    };
    let (mut child, desc) = ChildSink::spawn();
    let mut src = UcxSource::connect(&ctx, &desc, UcxSourceConfig::default()).expect("connect");
    let expected = put_plan(&mut src, 7, &plan());
    assert_eq!(child.crcs(), expected);
    let expected = put_plan(&mut src, 8, &plan());
    assert_eq!(child.crcs(), expected);
    drop(src);
    child.finish();
}

#[test]
fn flush_after_the_peer_died_is_an_error_not_a_hang() {
    let Some(ctx) = context_or_skip("flush_after_the_peer_died_is_an_error_not_a_hang") else {
        return;
    };
    let (mut child, desc) = ChildSink::spawn();
    let config = UcxSourceConfig {
        op_timeout: Duration::from_secs(3),
        close_timeout: Duration::from_secs(1),
    };
    let mut src = UcxSource::connect(&ctx, &desc, config).expect("connect");
    let expected = put_plan(&mut src, 9, &plan()[..8]);
    assert_eq!(child.crcs()[..], expected[..]);

    child.child.kill().unwrap();
    child.child.wait().unwrap();
    drop(child);
    let t0 = Instant::now();
    let page = vec![3u8; PAGE];
    // Puts may still complete locally (bytes handed to the transport); the flush
    // cannot. Whichever call notices first reports the peer gone.
    let mut err = None;
    for p in 0..PAGES as u32 {
        if let Err(e) = src.put(1, dest(p), &page) {
            err = Some(e);
            break;
        }
    }
    let err = match err {
        Some(e) => e,
        None => src.flush().expect_err("a flush to a dead peer must fail"),
    };
    let elapsed = t0.elapsed();
    eprintln!("peer gone after {elapsed:?}: {err}");
    assert!(matches!(err, TransportError::PeerGone(_)), "{err:?}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    // Once failed, the source stays failed and fast.
    let t1 = Instant::now();
    assert!(matches!(src.flush(), Err(TransportError::PeerGone(_))));
    assert!(matches!(
        src.put(1, dest(0), &page),
        Err(TransportError::PeerGone(_))
    ));
    assert!(t1.elapsed() < Duration::from_millis(100));
    let t2 = Instant::now();
    drop(src);
    assert!(
        t2.elapsed() < Duration::from_secs(3),
        "drop took {:?}",
        t2.elapsed()
    );
}
