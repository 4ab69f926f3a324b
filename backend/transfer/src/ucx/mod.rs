//! The `ucx` KV transport (DESIGN.md §6): one-sided puts from a prefill node into the
//! decode node's registered KV pool memory over UCX (UCP API), which picks shared
//! memory (`cma` into registered memory, `sysv`/`posix` into memory UCX allocated)
//! or TCP on these machines and RDMA verbs (`rc`/`ud`/`dc`) where the hardware
//! exists. The same code runs on all of them; `UCX_TLS` and
//! `UCX_NET_DEVICES` choose (see `ops/runbooks/ucx-transport.md`).
//!
//! UCX is loaded at run time (`dlopen("libucp.so.0")`, with `libloading`), so the
//! default build needs neither UCX headers nor libraries. Every constructor returns
//! [`UcxError::Unavailable`] on a machine without libucx.
//!
//! Two halves:
//! - [`UcxSink`] (decode side) registers the pool memory (`ucp_mem_map`; or
//!   allocates it through UCX, [`UcxSink::allocate`], faster on one machine), packs a
//!   remote key (`ucp_rkey_pack`) and publishes a [`UcxRegionDescriptor`] (worker
//!   address, base address, length, page size, packed rkey). Its owner thread must
//!   keep calling [`UcxSink::progress`] or [`UcxSink::progress_wait`]: over TCP (and
//!   for connection set-up on every transport) the bytes land only while the decode
//!   side's worker is progressed.
//! - [`UcxSource`] (prefill side) connects to a descriptor (`ucp_ep_create`,
//!   `ucp_ep_rkey_unpack`) and implements [`KvTransport`]: `put` is `ucp_put_nbx` to
//!   `base + page * page_bytes`, `flush` is `ucp_ep_flush_nbx`.
//!
//! Control messages (`Prealloc`, `Descriptor`, `Commit`, ...) do not go through this
//! module; the descriptor is plain serde data that the protocol carries.
//!
//! Threads: each [`UcxSink`] and [`UcxSource`] owns its own UCP worker, created in
//! `UCS_THREAD_MODE_SERIALIZED`; both are `Send` (move them to the thread that drives
//! them) and neither is `Sync`. A [`UcxContext`] is shared (`Clone`, `Send + Sync`)
//! and should be created once per process.

mod ffi;

use std::ffi::{c_int, c_void, CStr};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicI8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use self::ffi::{Api, UcpContextH, UcpEpH, UcpMemH, UcpRkeyH, UcpWorkerH, UcsStatus, UcsStatusPtr};
use crate::transport::{DestPage, KvTransport, TransportError};

/// A UCX failure, before it is mapped to a [`TransportError`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UcxError {
    /// libucp/libucs could not be loaded (or lack a 1.13 symbol). The message says
    /// how to install them.
    #[error("{0}")]
    Unavailable(String),
    /// A UCP call returned an error status.
    #[error("{call} failed: {message} (ucs_status_t {status})")]
    Call {
        /// The UCP function, e.g. `"ucp_put_nbx"`.
        call: &'static str,
        /// The raw `ucs_status_t`.
        status: i8,
        /// `ucs_status_string(status)`.
        message: String,
    },
    /// An operation did not complete before its deadline (the peer is presumed gone).
    #[error("{what} did not complete within {timeout:?}")]
    Timeout {
        /// What was waited for, e.g. `"ucp_ep_flush_nbx"`.
        what: &'static str,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// A region or descriptor that cannot be used (zero page size, length not
    /// addressable, empty worker address or rkey).
    #[error("invalid UCX region: {0}")]
    InvalidRegion(String),
}

impl UcxError {
    /// True when UCX itself is missing on this machine (not a transfer failure).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, UcxError::Unavailable(_))
    }

    /// True when the error means the remote side is unreachable or died: UCX's
    /// unreachable / not connected / connection reset / I/O error / canceled (forced
    /// close) statuses, any link or endpoint failure status, or a timeout.
    pub fn is_peer_gone(&self) -> bool {
        match self {
            UcxError::Timeout { .. } => true,
            UcxError::Call { status, .. } => {
                // UCS_ERR_IO_ERROR, UNREACHABLE, CANCELED, NOT_CONNECTED,
                // CONNECTION_RESET, then the link/endpoint failure ranges.
                matches!(*status, -3 | -6 | -16 | -24 | -25) || (-89..=-40).contains(status)
            }
            _ => false,
        }
    }
}

impl From<UcxError> for TransportError {
    fn from(e: UcxError) -> Self {
        if e.is_peer_gone() {
            TransportError::PeerGone(e.to_string())
        } else {
            TransportError::Library(e.to_string())
        }
    }
}

fn status_error(api: &Api, call: &'static str, status: UcsStatus) -> UcxError {
    // SAFETY: ucs_status_string accepts any status value and returns a pointer to a
    // static NUL-terminated string (or "unknown error").
    let s = unsafe { (api.status_string)(status) };
    let message = if s.is_null() {
        "unknown error".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated, static (see above).
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    };
    UcxError::Call {
        call,
        status,
        message,
    }
}

fn check(api: &Api, call: &'static str, status: UcsStatus) -> Result<(), UcxError> {
    if status == ffi::UCS_OK {
        Ok(())
    } else {
        Err(status_error(api, call, status))
    }
}

fn load_api() -> Result<&'static Api, UcxError> {
    ffi::api().map_err(UcxError::Unavailable)
}

/// Loads libucp and returns its version string (`ucp_get_version_string`, e.g.
/// `"1.13.1"`).
///
/// # Errors
/// [`UcxError::Unavailable`] when libucx is not installed.
pub fn ucx_version() -> Result<String, UcxError> {
    let api = load_api()?;
    // SAFETY: returns a pointer to a static NUL-terminated string.
    let s = unsafe { (api.get_version_string)() };
    if s.is_null() {
        return Ok(String::new());
    }
    // SAFETY: non-null static C string (see above).
    Ok(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
}

// ---- context -------------------------------------------------------------------

struct ContextInner {
    api: &'static Api,
    h: UcpContextH,
}

// SAFETY: the context is created with `mt_workers_shared = 1`, which makes UCP
// protect its context-level state (worker creation, memory mapping) with a lock, so
// the handle may be used from several threads.
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every worker and memory mapping holds an `Arc<ContextInner>`, so
        // none is alive any more; the handle came from ucp_init_version.
        unsafe { (self.api.cleanup)(self.h) };
    }
}

/// A UCP context (`ucp_init` with the RMA and WAKEUP features), configured from the
/// `UCX_*` environment variables (`UCX_TLS`, `UCX_NET_DEVICES`, ...) at creation.
/// Create one per process and clone it; it is destroyed (`ucp_cleanup`) when the
/// last clone and every sink and source made from it are gone.
#[derive(Clone)]
pub struct UcxContext {
    inner: Arc<ContextInner>,
}

impl std::fmt::Debug for UcxContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxContext")
            .field("handle", &self.inner.h)
            .finish()
    }
}

impl UcxContext {
    /// Loads libucp (first call only) and creates a context: `ucp_config_read`
    /// (environment), then `ucp_init_version(1, 13, ..)` with features
    /// `UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP`.
    ///
    /// # Errors
    /// [`UcxError::Unavailable`] without libucx; [`UcxError::Call`] when UCX rejects
    /// the configuration (e.g. a `UCX_TLS` naming no usable transport).
    pub fn new() -> Result<Self, UcxError> {
        let api = load_api()?;
        let mut config: *mut ffi::UcpConfig = ptr::null_mut();
        // SAFETY: null prefix and file mean "UCX_ from the environment, default
        // config file"; `config` is a valid out-pointer.
        check(api, "ucp_config_read", unsafe {
            (api.config_read)(ptr::null(), ptr::null(), &mut config)
        })?;
        let params = ffi::UcpParams {
            field_mask: ffi::UCP_PARAM_FIELD_FEATURES
                | ffi::UCP_PARAM_FIELD_MT_WORKERS_SHARED
                | ffi::UCP_PARAM_FIELD_NAME,
            features: ffi::UCP_FEATURE_RMA | ffi::UCP_FEATURE_WAKEUP,
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 1,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: c"tessera-kv".as_ptr(),
        };
        let mut h: UcpContextH = ptr::null_mut();
        // SAFETY: `params` is a fully initialised ucp_params_t whose mask names only
        // initialised fields; `config` came from ucp_config_read; `h` is a valid
        // out-pointer. The name string is static.
        let status = unsafe {
            (api.init_version)(
                ffi::UCP_API_MAJOR,
                ffi::UCP_API_MINOR,
                &params,
                config,
                &mut h,
            )
        };
        // SAFETY: ucp_init copies what it needs from the config; release it once.
        unsafe { (api.config_release)(config) };
        check(api, "ucp_init", status)?;
        Ok(UcxContext {
            inner: Arc::new(ContextInner { api, h }),
        })
    }
}

// ---- worker --------------------------------------------------------------------

/// One UCP worker (`UCS_THREAD_MODE_SERIALIZED`); destroyed on drop.
struct Worker {
    ctx: Arc<ContextInner>,
    h: UcpWorkerH,
}

impl Worker {
    fn new(ctx: &UcxContext) -> Result<Self, UcxError> {
        let api = ctx.inner.api;
        // SAFETY: all-zero is a valid ucp_worker_params_t (integers, null pointers,
        // an empty CPU set); only the thread mode is then set and named in the mask.
        let mut params: ffi::UcpWorkerParams = unsafe { std::mem::zeroed() };
        params.field_mask = ffi::UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        params.thread_mode = ffi::UCS_THREAD_MODE_SERIALIZED;
        let mut h: UcpWorkerH = ptr::null_mut();
        // SAFETY: live context handle, initialised params, valid out-pointer.
        check(api, "ucp_worker_create", unsafe {
            (api.worker_create)(ctx.inner.h, &params, &mut h)
        })?;
        Ok(Worker {
            ctx: Arc::clone(&ctx.inner),
            h,
        })
    }

    fn api(&self) -> &'static Api {
        self.ctx.api
    }

    fn progress(&self) -> u32 {
        // SAFETY: live worker handle; the owner (sink or source, not Sync) is the
        // only caller at any time, as SERIALIZED mode requires.
        unsafe { (self.api().worker_progress)(self.h) }
    }

    /// The worker's address (`ucp_worker_get_address`), copied out.
    fn address(&self) -> Result<Vec<u8>, UcxError> {
        let api = self.api();
        let mut addr: *mut ffi::UcpAddress = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live worker handle, valid out-pointers.
        check(api, "ucp_worker_get_address", unsafe {
            (api.worker_get_address)(self.h, &mut addr, &mut len)
        })?;
        // SAFETY: UCP returned `len` readable bytes at `addr`, valid until released.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: `addr` came from ucp_worker_get_address on this worker.
        unsafe { (api.worker_release_address)(self.h, addr) };
        Ok(bytes)
    }

    /// Drives `req` (a `ucs_status_ptr_t` from a `*_nbx` call) to completion by
    /// progressing this worker, until `deadline`. Frees the request either way.
    fn wait(
        &self,
        call: &'static str,
        req: UcsStatusPtr,
        timeout: Duration,
        ep_status: Option<&AtomicI8>,
    ) -> Result<(), UcxError> {
        let api = self.api();
        if req.is_null() {
            return Ok(());
        }
        if ffi::ptr_is_err(req) {
            return Err(status_error(api, call, ffi::ptr_status(req)));
        }
        debug_assert!(ffi::ptr_is_ptr(req));
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            self.progress();
            // SAFETY: `req` is a live request handle returned by UCP and not freed yet.
            let status = unsafe { (api.request_check_status)(req) };
            if status != ffi::UCS_INPROGRESS {
                // SAFETY: completed request, freed exactly once.
                unsafe { (api.request_free)(req) };
                return check(api, call, status);
            }
            spins = spins.wrapping_add(1);
            if spins & 63 == 0 {
                let failed = ep_status
                    .map(|s| s.load(Ordering::Acquire))
                    .unwrap_or(ffi::UCS_OK);
                if failed != ffi::UCS_OK || Instant::now() >= deadline {
                    // SAFETY: hands the unfinished request back to UCP, which
                    // releases it when it completes (or when the endpoint is
                    // force-closed); it is never touched again here.
                    unsafe { (api.request_free)(req) };
                    if failed != ffi::UCS_OK {
                        return Err(status_error(api, call, failed));
                    }
                    return Err(UcxError::Timeout {
                        what: call,
                        timeout,
                    });
                }
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: the owners destroy their endpoints and rkeys before the worker
        // (field order / explicit Drop); the handle is live and destroyed once.
        unsafe { (self.api().worker_destroy)(self.h) };
    }
}

// ---- descriptor ----------------------------------------------------------------

/// What a prefill node needs to write into a decode node's registered pages: the
/// decode worker's UCP address, the registered region and its packed remote key.
/// Plain data (serde); carried by the protocol's `Descriptor` message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UcxRegionDescriptor {
    /// `ucp_worker_get_address` of the sink's worker (opaque bytes).
    pub worker_address: Vec<u8>,
    /// Virtual address of page 0 in the sink process.
    pub base: u64,
    /// Region length in bytes (`pages * page_bytes`).
    pub len: u64,
    /// Bytes per page; page `p` starts at `base + p * page_bytes`.
    pub page_bytes: u64,
    /// `ucp_rkey_pack` of the region's memory handle (opaque bytes).
    pub rkey: Vec<u8>,
}

impl UcxRegionDescriptor {
    /// Number of whole pages in the region (`len / page_bytes`).
    pub fn pages(&self) -> u64 {
        self.len.checked_div(self.page_bytes).unwrap_or(0)
    }
}

// ---- sink ----------------------------------------------------------------------

/// A region must be a whole, non-zero number of pages.
fn check_region(len: u64, page_bytes: u64) -> Result<(), UcxError> {
    if len == 0 || len.checked_rem(page_bytes) != Some(0) {
        return Err(UcxError::InvalidRegion(format!(
            "length {len} must be a non-zero multiple of page_bytes {page_bytes}"
        )));
    }
    Ok(())
}

/// `ucp_mem_map` parameters for a host region remote peers may write: `address`
/// registers existing memory, a null `address` asks UCX to allocate it
/// (`UCP_MEM_MAP_ALLOCATE`).
fn mem_map_params(
    address: *mut c_void,
    len: usize,
    page_bytes: usize,
) -> Result<ffi::UcpMemMapParams, UcxError> {
    check_region(len as u64, page_bytes as u64)?;
    let allocate = address.is_null();
    Ok(ffi::UcpMemMapParams {
        field_mask: ffi::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | ffi::UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | if allocate {
                ffi::UCP_MEM_MAP_PARAM_FIELD_FLAGS
            } else {
                0
            }
            | ffi::UCP_MEM_MAP_PARAM_FIELD_PROT
            | ffi::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
        address,
        length: len,
        flags: if allocate {
            ffi::UCP_MEM_MAP_ALLOCATE
        } else {
            0
        },
        prot: ffi::UCP_MEM_MAP_PROT_LOCAL_READ
            | ffi::UCP_MEM_MAP_PROT_LOCAL_WRITE
            | ffi::UCP_MEM_MAP_PROT_REMOTE_WRITE,
        memory_type: ffi::UCS_MEMORY_TYPE_HOST,
    })
}

/// Decode side: a registered destination region (`ucp_mem_map` of existing memory
/// with local read/write and remote write access) on its own worker.
///
/// Dropping it unmaps the region (`ucp_mem_unmap`) and destroys the worker; a source
/// still connected then gets errors (or timeouts) from `put`/`flush`. Drop it only
/// after the protocol has drained every transfer into it (I5).
pub struct UcxSink {
    // Field order is drop order: unmap (through `Mapping`) before the worker goes.
    // Held for its Drop (ucp_mem_unmap).
    _mapping: Mapping,
    worker: Worker,
    efd: c_int,
    descriptor: UcxRegionDescriptor,
}

struct Mapping {
    ctx: Arc<ContextInner>,
    memh: UcpMemH,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `memh` came from ucp_mem_map on this context and is unmapped once.
        let _ = unsafe { (self.ctx.api.mem_unmap)(self.ctx.h, self.memh) };
    }
}

// SAFETY: the worker is SERIALIZED and the sink is not Sync, so only the thread that
// currently owns the sink touches the worker; the mapping is context-level state the
// context protects (mt_workers_shared).
unsafe impl Send for UcxSink {}

impl std::fmt::Debug for UcxSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxSink")
            .field("base", &format_args!("{:#x}", self.descriptor.base))
            .field("len", &self.descriptor.len)
            .field("page_bytes", &self.descriptor.page_bytes)
            .finish()
    }
}

impl UcxSink {
    /// Registers `len` bytes at `base` (page-major, `page_bytes` bytes per page) for
    /// remote writes and creates the worker that serves them.
    ///
    /// # Safety
    /// `base..base + len` must be one live allocation that outlives the sink, and
    /// the caller must not rely on its contents while a transfer into it can still
    /// be in flight: any holder of the descriptor can write any byte of it until the
    /// sink is dropped. Read a page only after the writer's `flush` completed (the
    /// protocol's `Commit`).
    ///
    /// # Errors
    /// [`UcxError::InvalidRegion`] when `len` or `page_bytes` is zero or `len` is
    /// not a multiple of `page_bytes`; [`UcxError::Unavailable`] / [`UcxError::Call`]
    /// from `ucp_worker_create`, `ucp_mem_map`, `ucp_rkey_pack`,
    /// `ucp_worker_get_address` or `ucp_worker_get_efd`.
    pub unsafe fn register(
        ctx: &UcxContext,
        base: NonNull<u8>,
        len: usize,
        page_bytes: usize,
    ) -> Result<Self, UcxError> {
        let params = mem_map_params(base.as_ptr() as *mut c_void, len, page_bytes)?;
        // SAFETY: the caller guarantees the range is one live allocation for the
        // sink's life.
        unsafe { Self::map(ctx, &params, page_bytes) }
    }

    /// Allocates a zeroed-on-first-touch region of `len` bytes owned by the sink
    /// (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`), registered like
    /// [`register`](Self::register). UCX picks the allocator (`UCX_ALLOC_PRIO`): on
    /// these machines System V shared memory, which the shared-memory transports
    /// write with a plain `memcpy` instead of a `process_vm_writev` system call per
    /// put (see docs/benchmarks.md). Read it through [`region`](Self::region).
    ///
    /// # Errors
    /// As [`register`](Self::register).
    pub fn allocate(ctx: &UcxContext, len: usize, page_bytes: usize) -> Result<Self, UcxError> {
        // A null address with the ALLOCATE flag: UCX allocates the region.
        let params = mem_map_params(ptr::null_mut(), len, page_bytes)?;
        // SAFETY: UCX allocates the memory itself and frees it at ucp_mem_unmap,
        // when the sink drops.
        unsafe { Self::map(ctx, &params, page_bytes) }
    }

    /// The region's first byte (page 0). Valid while the sink lives; the same
    /// concurrency rule as in [`register`](Self::register) applies to reading it.
    pub fn region(&self) -> NonNull<u8> {
        NonNull::new(self.descriptor.base as *mut u8).expect("mapped region is not null")
    }

    /// Maps per `params`, packs the rkey, creates the worker and the descriptor.
    ///
    /// # Safety
    /// Without `UCP_MEM_MAP_ALLOCATE`, `params.address..+length` must be one live
    /// allocation that outlives the sink.
    unsafe fn map(
        ctx: &UcxContext,
        params: &ffi::UcpMemMapParams,
        page_bytes: usize,
    ) -> Result<Self, UcxError> {
        let api = ctx.inner.api;
        let worker = Worker::new(ctx)?;
        let mut memh: UcpMemH = ptr::null_mut();
        // SAFETY: the caller guarantees the range (or UCX allocates it); params are
        // initialised; `memh` is a valid out-pointer.
        check(api, "ucp_mem_map", unsafe {
            (api.mem_map)(ctx.inner.h, params, &mut memh)
        })?;
        let mapping = Mapping {
            ctx: Arc::clone(&ctx.inner),
            memh,
        };
        let base = if params.flags & ffi::UCP_MEM_MAP_ALLOCATE == 0 {
            params.address as u64
        } else {
            let mut attr = ffi::UcpMemAttr {
                field_mask: ffi::UCP_MEM_ATTR_FIELD_ADDRESS | ffi::UCP_MEM_ATTR_FIELD_LENGTH,
                address: ptr::null_mut(),
                length: 0,
                mem_type: 0,
            };
            // SAFETY: live memory handle; `attr` names only the address and length.
            check(api, "ucp_mem_query", unsafe {
                (api.mem_query)(memh, &mut attr)
            })?;
            if attr.address.is_null() || attr.length < params.length {
                return Err(UcxError::InvalidRegion(format!(
                    "ucp_mem_map allocated {} bytes at {:p} for {} requested",
                    attr.length, attr.address, params.length
                )));
            }
            attr.address as u64
        };
        let len = params.length;

        let mut rkey_buf: *mut c_void = ptr::null_mut();
        let mut rkey_len = 0usize;
        // SAFETY: live context and memory handle; valid out-pointers.
        check(api, "ucp_rkey_pack", unsafe {
            (api.rkey_pack)(ctx.inner.h, memh, &mut rkey_buf, &mut rkey_len)
        })?;
        // SAFETY: UCP returned `rkey_len` readable bytes at `rkey_buf`.
        let rkey = unsafe { std::slice::from_raw_parts(rkey_buf as *const u8, rkey_len) }.to_vec();
        // SAFETY: the buffer came from ucp_rkey_pack and is released once.
        unsafe { (api.rkey_buffer_release)(rkey_buf) };

        let worker_address = worker.address()?;
        let mut efd: c_int = -1;
        // SAFETY: live worker of a context with UCP_FEATURE_WAKEUP; valid out-pointer.
        check(api, "ucp_worker_get_efd", unsafe {
            (api.worker_get_efd)(worker.h, &mut efd)
        })?;
        let descriptor = UcxRegionDescriptor {
            worker_address,
            base,
            len: len as u64,
            page_bytes: page_bytes as u64,
            rkey,
        };
        Ok(UcxSink {
            _mapping: mapping,
            worker,
            efd,
            descriptor,
        })
    }

    /// The descriptor to hand to prefill nodes.
    pub fn descriptor(&self) -> &UcxRegionDescriptor {
        &self.descriptor
    }

    /// One non-blocking `ucp_worker_progress`; returns the number of events handled.
    /// Call it in a loop (or use [`progress_wait`](Self::progress_wait)) for as long
    /// as sources may write.
    pub fn progress(&self) -> u32 {
        self.worker.progress()
    }

    /// Progresses until idle, then sleeps on the worker's event fd (`ucp_worker_arm`,
    /// then `poll`) for at most `timeout` or until UCX has work; returns the number
    /// of events handled. Lets a decode node's progress thread idle without spinning.
    ///
    /// # Errors
    /// [`UcxError::Call`] when `ucp_worker_arm` or `poll` fails.
    pub fn progress_wait(&self, timeout: Duration) -> Result<u32, UcxError> {
        let mut n = 0;
        loop {
            let k = self.worker.progress();
            if k == 0 {
                break;
            }
            n += k;
        }
        if n > 0 {
            return Ok(n);
        }
        let api = self.worker.api();
        // SAFETY: live worker with UCP_FEATURE_WAKEUP; owner thread only.
        let status = unsafe { (api.worker_arm)(self.worker.h) };
        if status == ffi::UCS_ERR_BUSY {
            return Ok(self.worker.progress());
        }
        check(api, "ucp_worker_arm", status)?;
        let mut fds = [PollFd {
            fd: self.efd,
            events: POLLIN,
            revents: 0,
        }];
        let ms = timeout.as_millis().min(i32::MAX as u128) as c_int;
        // SAFETY: one valid pollfd for an fd owned by the worker (alive with self).
        let rc = unsafe { poll(fds.as_mut_ptr(), 1, ms) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(UcxError::Call {
                    call: "poll",
                    status: 0,
                    message: err.to_string(),
                });
            }
        }
        Ok(self.worker.progress())
    }
}

#[repr(C)]
struct PollFd {
    fd: c_int,
    events: i16,
    revents: i16,
}
const POLLIN: i16 = 0x001;
extern "C" {
    fn poll(fds: *mut PollFd, nfds: std::ffi::c_ulong, timeout: c_int) -> c_int;
}

// ---- source --------------------------------------------------------------------

/// Tuning for a [`UcxSource`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UcxSourceConfig {
    /// Longest wait for one put's local completion or one flush before the peer is
    /// declared gone ([`TransportError::PeerGone`]); the source is unusable after.
    pub op_timeout: Duration,
    /// Longest wait for the final flush and endpoint close when the source is dropped.
    pub close_timeout: Duration,
}

impl Default for UcxSourceConfig {
    /// 10 s per operation (a 288,000-byte page takes well under 1 ms on every
    /// transport here), 2 s to close.
    fn default() -> Self {
        UcxSourceConfig {
            op_timeout: Duration::from_secs(10),
            close_timeout: Duration::from_secs(2),
        }
    }
}

/// Endpoint error state written by UCX's error callback (`UCS_OK` while healthy).
struct EpState {
    status: AtomicI8,
}

unsafe extern "C" fn ep_error_cb(arg: *mut c_void, _ep: UcpEpH, status: UcsStatus) {
    // SAFETY: `arg` is the `EpState` boxed in the UcxSource that created this
    // endpoint; the box outlives the endpoint (dropped after ep close and worker
    // destroy).
    let state = unsafe { &*(arg as *const EpState) };
    state.status.store(
        if status == ffi::UCS_OK { -3 } else { status },
        Ordering::Release,
    );
}

/// Prefill side: an endpoint to one decode node's [`UcxSink`] plus the unpacked
/// remote key of its region; implements [`KvTransport`].
///
/// `put` waits for *local* completion of `ucp_put_nbx` before it returns (no bounce
/// buffer, no copy): the source slice may be reused immediately, and the bytes are
/// in flight or landed. `flush` (`ucp_ep_flush_nbx`) waits for *remote* completion.
/// Endpoints use `UCP_ERR_HANDLING_MODE_PEER` where the transports support it (TCP,
/// RDMA verbs), so a dead peer surfaces as an endpoint error; UCX 1.13's
/// shared-memory transports do not, and there the endpoint runs without error
/// handling (UCX logs one "no peer failure handler" line per connect, see
/// [`peer_failure_detection`](Self::peer_failure_detection)). Every wait also has a
/// deadline ([`UcxSourceConfig::op_timeout`]), so a dead peer is an error, never a
/// hang. After any
/// failure the source stays failed and returns [`TransportError::PeerGone`] (or the
/// first error) from every call: make a new one.
pub struct UcxSource {
    // Drop is explicit (rkey, then endpoint, then worker, then `ep_state`).
    worker: Worker,
    ep: UcpEpH,
    rkey: UcpRkeyH,
    ep_state: Box<EpState>,
    base: u64,
    len: u64,
    page_bytes: u64,
    config: UcxSourceConfig,
    failed: Option<TransportError>,
    peer_failure_detection: bool,
}

// SAFETY: the worker is SERIALIZED; endpoint and rkey belong to it and are used only
// through `&mut self`, so one thread at a time. `ep_state` is an atomic.
unsafe impl Send for UcxSource {}

impl std::fmt::Debug for UcxSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxSource")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("page_bytes", &self.page_bytes)
            .field("failed", &self.failed)
            .finish()
    }
}

impl UcxSource {
    /// Creates a worker, an endpoint to `desc.worker_address` (`ucp_ep_create`, peer
    /// error handling) and unpacks `desc.rkey` (`ucp_ep_rkey_unpack`).
    ///
    /// # Errors
    /// [`UcxError::InvalidRegion`] for a descriptor with an empty address or rkey,
    /// zero page size or a length that is not a multiple of it;
    /// [`UcxError::Call`] when UCP rejects the address or key (e.g. no common
    /// transport with the sink under the current `UCX_TLS`).
    pub fn connect(
        ctx: &UcxContext,
        desc: &UcxRegionDescriptor,
        config: UcxSourceConfig,
    ) -> Result<Self, UcxError> {
        if desc.worker_address.is_empty() || desc.rkey.is_empty() {
            return Err(UcxError::InvalidRegion(
                "descriptor has no worker address or rkey".into(),
            ));
        }
        check_region(desc.len, desc.page_bytes)?;
        if desc.base.checked_add(desc.len).is_none() {
            return Err(UcxError::InvalidRegion(format!(
                "region {:#x} + {} overflows the address space",
                desc.base, desc.len
            )));
        }
        let api = ctx.inner.api;
        let worker = Worker::new(ctx)?;
        let ep_state = Box::new(EpState {
            status: AtomicI8::new(ffi::UCS_OK),
        });
        // SAFETY: all-zero is a valid ucp_ep_params_t (integers, null pointers, no
        // callback); the fields named in the mask are set below.
        let mut params: ffi::UcpEpParams = unsafe { std::mem::zeroed() };
        params.field_mask = ffi::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLER;
        params.address = desc.worker_address.as_ptr() as *const c_void;
        params.err_mode = ffi::UCP_ERR_HANDLING_MODE_PEER;
        params.err_handler = ffi::UcpErrHandler {
            cb: Some(ep_error_cb),
            arg: &*ep_state as *const EpState as *mut c_void,
        };
        let mut ep: UcpEpH = ptr::null_mut();
        // SAFETY: live worker; the address bytes are valid for the call (UCP copies
        // what it needs); the error-handler argument outlives the endpoint.
        let mut status = unsafe { (api.ep_create)(worker.h, &params, &mut ep) };
        let mut peer_failure_detection = true;
        if status == ffi::UCS_ERR_UNREACHABLE {
            // UCX 1.13's shared-memory transports (sysv, posix) have no peer failure
            // handler, so no lane qualifies under UCP_ERR_HANDLING_MODE_PEER. Fall
            // back to no error handling; deadlines still turn a dead peer into
            // PeerGone.
            tracing::debug!("ucx: no transport with peer failure detection; using deadlines only");
            params.field_mask = ffi::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
            params.err_mode = 0;
            params.err_handler = ffi::UcpErrHandler {
                cb: None,
                arg: ptr::null_mut(),
            };
            peer_failure_detection = false;
            // SAFETY: as above.
            status = unsafe { (api.ep_create)(worker.h, &params, &mut ep) };
        }
        check(api, "ucp_ep_create", status)?;
        let mut rkey: UcpRkeyH = ptr::null_mut();
        // SAFETY: live endpoint; `desc.rkey` holds a packed key (UCP validates it).
        let status =
            unsafe { (api.ep_rkey_unpack)(ep, desc.rkey.as_ptr() as *const c_void, &mut rkey) };
        let mut source = UcxSource {
            worker,
            ep,
            rkey: ptr::null_mut(),
            ep_state,
            base: desc.base,
            len: desc.len,
            page_bytes: desc.page_bytes,
            config,
            failed: None,
            peer_failure_detection,
        };
        if status != ffi::UCS_OK {
            source.failed = Some(TransportError::Library("rkey unpack failed".into()));
            return Err(status_error(api, "ucp_ep_rkey_unpack", status));
        }
        source.rkey = rkey;
        Ok(source)
    }

    /// The region's size in bytes.
    pub fn region_len(&self) -> u64 {
        self.len
    }

    /// Bytes per destination page.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Whether the endpoint runs with `UCP_ERR_HANDLING_MODE_PEER` (UCX reports a
    /// dead peer as an endpoint error). False when no transport in use supports it
    /// (UCX 1.13 shared memory): then a dead peer is detected by
    /// [`UcxSourceConfig::op_timeout`] alone.
    pub fn peer_failure_detection(&self) -> bool {
        self.peer_failure_detection
    }

    fn usable(&self) -> Result<(), TransportError> {
        if let Some(e) = &self.failed {
            return Err(match e {
                TransportError::PeerGone(_) => e.clone(),
                other => TransportError::PeerGone(format!("source failed earlier: {other}")),
            });
        }
        let s = self.ep_state.status.load(Ordering::Acquire);
        if s != ffi::UCS_OK {
            return Err(status_error(self.worker.api(), "endpoint", s).into());
        }
        Ok(())
    }

    /// Records the first failure and force-closes the endpoint at once, which
    /// cancels every outstanding operation: after this returns UCX no longer reads
    /// any caller buffer.
    fn fail(&mut self, e: UcxError) -> TransportError {
        let t: TransportError = e.into();
        self.failed = Some(t.clone());
        self.teardown(true);
        t
    }

    /// Destroys the rkey, then closes the endpoint (forced: no flush, outstanding
    /// requests cancelled). Idempotent.
    fn teardown(&mut self, force: bool) {
        let api = self.worker.api();
        if !self.rkey.is_null() {
            // SAFETY: every put using the key was flushed (unforced close) or is
            // about to be cancelled by the forced close; the key was unpacked on
            // `self.ep`, which is still alive; destroyed once (nulled below).
            unsafe { (api.rkey_destroy)(self.rkey) };
            self.rkey = ptr::null_mut();
        }
        if self.ep.is_null() {
            return;
        }
        let mut param = ffi::UcpRequestParam::empty();
        if force {
            param.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = ffi::UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: live endpoint, closed exactly once (nulled below); no callback.
        let req = unsafe { (api.ep_close_nbx)(self.ep, &param) };
        self.ep = ptr::null_mut();
        let _ = self
            .worker
            .wait("ucp_ep_close_nbx", req, self.config.close_timeout, None);
    }

    fn flush_within(&mut self, timeout: Duration) -> Result<(), UcxError> {
        let api = self.worker.api();
        let param = ffi::UcpRequestParam::empty();
        // SAFETY: live endpoint; empty params (no callback).
        let req = unsafe { (api.ep_flush_nbx)(self.ep, &param) };
        self.worker.wait(
            "ucp_ep_flush_nbx",
            req,
            timeout,
            Some(&self.ep_state.status),
        )
    }
}

impl KvTransport for UcxSource {
    /// `ucp_put_nbx` of `bytes` to `base + dest.page * page_bytes`, then progress
    /// until local completion. `req` is not used by the transport.
    ///
    /// Errors: [`TransportError::OutOfBounds`] when the page does not lie inside the
    /// region (`region` = region length) or `bytes` is longer than one page
    /// (`offset` = 0, `region` = `page_bytes`); [`TransportError::PeerGone`] when the
    /// endpoint failed or local completion timed out.
    fn put(&mut self, _req: u64, dest: DestPage, bytes: &[u8]) -> Result<(), TransportError> {
        self.usable()?;
        let len = bytes.len() as u64;
        if len > self.page_bytes {
            return Err(TransportError::OutOfBounds {
                offset: 0,
                len,
                region: self.page_bytes,
            });
        }
        let offset = u64::from(dest.page) * self.page_bytes;
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(TransportError::OutOfBounds {
                offset,
                len,
                region: self.len,
            });
        }
        if bytes.is_empty() {
            return Ok(());
        }
        let api = self.worker.api();
        let mut param = ffi::UcpRequestParam::empty();
        param.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        param.memory_type = ffi::UCS_MEMORY_TYPE_HOST;
        // SAFETY: live endpoint and rkey; `bytes` is readable for `len` bytes and
        // stays borrowed until the wait below reports local completion (or hands
        // the request back after a failure, when the endpoint is already broken and
        // is force-closed before the caller could observe a late read); the remote
        // range was bounds-checked against the registered region.
        let req = unsafe {
            (api.put_nbx)(
                self.ep,
                bytes.as_ptr() as *const c_void,
                bytes.len(),
                self.base + offset,
                self.rkey,
                &param,
            )
        };
        let timeout = self.config.op_timeout;
        match self
            .worker
            .wait("ucp_put_nbx", req, timeout, Some(&self.ep_state.status))
        {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// `ucp_ep_flush_nbx`, progressing until every earlier put is complete at the
    /// destination. Errors: [`TransportError::PeerGone`] when the endpoint failed or
    /// the flush did not finish within [`UcxSourceConfig::op_timeout`].
    fn flush(&mut self) -> Result<(), TransportError> {
        self.usable()?;
        let timeout = self.config.op_timeout;
        self.flush_within(timeout).map_err(|e| self.fail(e))
    }
}

impl Drop for UcxSource {
    fn drop(&mut self) {
        let healthy = self.failed.is_none()
            && !self.ep.is_null()
            && self.ep_state.status.load(Ordering::Acquire) == ffi::UCS_OK
            && self.flush_within(self.config.close_timeout).is_ok();
        self.teardown(!healthy);
        // `worker` (destroyed in its Drop) and then `ep_state` drop after this.
    }
}
