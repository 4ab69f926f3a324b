//! Hand-written declarations of the part of the UCP C API (UCX 1.13, `ucp/api/ucp.h`)
//! that the transport uses, and the run-time loader that resolves them from
//! `libucp.so.0` / `libucs.so.0` with `libloading`. Nothing here links UCX at build
//! time.
//!
//! Every struct is `repr(C)` and mirrors the C layout field by field (checked in the
//! tests below against sizes and offsets printed by a C program compiled against the
//! 1.13.1 headers). UCX reads only the fields its `field_mask` names, but the structs
//! are complete so that the library never reads past them.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

/// `ucs_status_t`: a packed enum in C, so one signed byte.
pub(crate) type UcsStatus = i8;
/// `ucs_status_ptr_t`: a request pointer, or a status cast to a pointer.
pub(crate) type UcsStatusPtr = *mut c_void;

/// Opaque UCP handles.
pub(crate) type UcpContextH = *mut c_void;
pub(crate) type UcpWorkerH = *mut c_void;
pub(crate) type UcpEpH = *mut c_void;
pub(crate) type UcpMemH = *mut c_void;
pub(crate) type UcpRkeyH = *mut c_void;
pub(crate) type UcpConfig = c_void;
pub(crate) type UcpAddress = c_void;

pub(crate) const UCS_OK: UcsStatus = 0;
pub(crate) const UCS_INPROGRESS: UcsStatus = 1;
pub(crate) const UCS_ERR_UNREACHABLE: UcsStatus = -6;
pub(crate) const UCS_ERR_BUSY: UcsStatus = -15;
/// `UCS_ERR_LAST`: statuses are in `(UCS_ERR_LAST, 1]`.
pub(crate) const UCS_ERR_LAST: isize = -100;

/// `UCP_API_MAJOR` / `UCP_API_MINOR` of the headers these declarations mirror; passed
/// to `ucp_init_version` (what the C `ucp_init` inline does).
pub(crate) const UCP_API_MAJOR: c_uint = 1;
pub(crate) const UCP_API_MINOR: c_uint = 13;

// ucp_params_field
pub(crate) const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(crate) const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub(crate) const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
// ucp_feature
pub(crate) const UCP_FEATURE_RMA: u64 = 1 << 1;
pub(crate) const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
// ucp_worker_params_field
pub(crate) const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
// ucs_thread_mode_t
pub(crate) const UCS_THREAD_MODE_SERIALIZED: c_int = 1;
// ucp_ep_params_field
pub(crate) const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
// ucp_err_handling_mode_t
pub(crate) const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
// ucp_ep_close_flags_t
pub(crate) const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;
// ucp_mem_map_params_field
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
// ucp_mem_map flags
pub(crate) const UCP_MEM_MAP_ALLOCATE: c_uint = 1 << 1;
// ucp_mem_attr_field
pub(crate) const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;
// ucp_mem_map_prot
pub(crate) const UCP_MEM_MAP_PROT_LOCAL_READ: c_uint = 1 << 0;
pub(crate) const UCP_MEM_MAP_PROT_LOCAL_WRITE: c_uint = 1 << 1;
pub(crate) const UCP_MEM_MAP_PROT_REMOTE_WRITE: c_uint = 1 << 9;
// ucs_memory_type_t
pub(crate) const UCS_MEMORY_TYPE_HOST: c_int = 0;
// ucp_op_attr_t
pub(crate) const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub(crate) const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;

/// `ucp_params_t`.
#[repr(C)]
pub(crate) struct UcpParams {
    pub(crate) field_mask: u64,
    pub(crate) features: u64,
    pub(crate) request_size: usize,
    pub(crate) request_init: Option<unsafe extern "C" fn(*mut c_void)>,
    pub(crate) request_cleanup: Option<unsafe extern "C" fn(*mut c_void)>,
    pub(crate) tag_sender_mask: u64,
    pub(crate) mt_workers_shared: c_int,
    pub(crate) estimated_num_eps: usize,
    pub(crate) estimated_num_ppn: usize,
    pub(crate) name: *const c_char,
}

/// `ucs_cpu_set_t`: 1024 bits.
#[repr(C)]
pub(crate) struct UcsCpuSet {
    pub(crate) bits: [u64; 16],
}

/// `ucp_worker_params_t`.
#[repr(C)]
pub(crate) struct UcpWorkerParams {
    pub(crate) field_mask: u64,
    pub(crate) thread_mode: c_int,
    pub(crate) cpu_mask: UcsCpuSet,
    pub(crate) events: c_uint,
    pub(crate) user_data: *mut c_void,
    pub(crate) event_fd: c_int,
    pub(crate) flags: u64,
    pub(crate) name: *const c_char,
    pub(crate) am_alignment: usize,
    pub(crate) client_id: u64,
}

/// `ucp_err_handler_cb_t`.
pub(crate) type UcpErrHandlerCb =
    unsafe extern "C" fn(arg: *mut c_void, ep: UcpEpH, status: UcsStatus);

/// `ucp_err_handler_t`.
#[repr(C)]
pub(crate) struct UcpErrHandler {
    pub(crate) cb: Option<UcpErrHandlerCb>,
    pub(crate) arg: *mut c_void,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub(crate) struct UcsSockAddr {
    pub(crate) addr: *const c_void,
    pub(crate) addrlen: u32,
}

/// `ucp_ep_params_t`.
#[repr(C)]
pub(crate) struct UcpEpParams {
    pub(crate) field_mask: u64,
    pub(crate) address: *const UcpAddress,
    pub(crate) err_mode: c_int,
    pub(crate) err_handler: UcpErrHandler,
    pub(crate) user_data: *mut c_void,
    pub(crate) flags: c_uint,
    pub(crate) sockaddr: UcsSockAddr,
    pub(crate) conn_request: *mut c_void,
    pub(crate) name: *const c_char,
    pub(crate) local_sockaddr: UcsSockAddr,
}

/// `ucp_mem_map_params_t`.
#[repr(C)]
pub(crate) struct UcpMemMapParams {
    pub(crate) field_mask: u64,
    pub(crate) address: *mut c_void,
    pub(crate) length: usize,
    pub(crate) flags: c_uint,
    pub(crate) prot: c_uint,
    pub(crate) memory_type: c_int,
}

/// `ucp_mem_attr_t`.
#[repr(C)]
pub(crate) struct UcpMemAttr {
    pub(crate) field_mask: u64,
    pub(crate) address: *mut c_void,
    pub(crate) length: usize,
    pub(crate) mem_type: c_int,
}

/// `ucp_request_param_t`. The two unions (`cb`, `recv_info`) are one pointer each.
#[repr(C)]
pub(crate) struct UcpRequestParam {
    pub(crate) op_attr_mask: u32,
    pub(crate) flags: u32,
    pub(crate) request: *mut c_void,
    pub(crate) cb: *mut c_void,
    pub(crate) datatype: u64,
    pub(crate) user_data: *mut c_void,
    pub(crate) reply_buffer: *mut c_void,
    pub(crate) memory_type: c_int,
    pub(crate) recv_info: *mut c_void,
    pub(crate) memh: UcpMemH,
}

impl UcpRequestParam {
    /// No optional field set: default datatype (contiguous bytes), no callback.
    pub(crate) fn empty() -> Self {
        // SAFETY: every field is an integer or a raw pointer; all-zero is valid
        // (null pointers, empty masks).
        unsafe { std::mem::zeroed() }
    }
}

/// Function table resolved from the shared libraries. The libraries stay loaded for
/// the life of the process (they live in a `static`), so the copied function
/// pointers stay valid.
#[allow(clippy::type_complexity)]
pub(crate) struct Api {
    pub(crate) config_read:
        unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut UcpConfig) -> UcsStatus,
    pub(crate) config_release: unsafe extern "C" fn(*mut UcpConfig),
    pub(crate) init_version: unsafe extern "C" fn(
        c_uint,
        c_uint,
        *const UcpParams,
        *const UcpConfig,
        *mut UcpContextH,
    ) -> UcsStatus,
    pub(crate) cleanup: unsafe extern "C" fn(UcpContextH),
    pub(crate) get_version_string: unsafe extern "C" fn() -> *const c_char,
    pub(crate) worker_create:
        unsafe extern "C" fn(UcpContextH, *const UcpWorkerParams, *mut UcpWorkerH) -> UcsStatus,
    pub(crate) worker_destroy: unsafe extern "C" fn(UcpWorkerH),
    pub(crate) worker_get_address:
        unsafe extern "C" fn(UcpWorkerH, *mut *mut UcpAddress, *mut usize) -> UcsStatus,
    pub(crate) worker_release_address: unsafe extern "C" fn(UcpWorkerH, *mut UcpAddress),
    pub(crate) worker_progress: unsafe extern "C" fn(UcpWorkerH) -> c_uint,
    pub(crate) worker_get_efd: unsafe extern "C" fn(UcpWorkerH, *mut c_int) -> UcsStatus,
    pub(crate) worker_arm: unsafe extern "C" fn(UcpWorkerH) -> UcsStatus,
    pub(crate) ep_create:
        unsafe extern "C" fn(UcpWorkerH, *const UcpEpParams, *mut UcpEpH) -> UcsStatus,
    pub(crate) ep_close_nbx: unsafe extern "C" fn(UcpEpH, *const UcpRequestParam) -> UcsStatusPtr,
    pub(crate) ep_flush_nbx: unsafe extern "C" fn(UcpEpH, *const UcpRequestParam) -> UcsStatusPtr,
    pub(crate) mem_map:
        unsafe extern "C" fn(UcpContextH, *const UcpMemMapParams, *mut UcpMemH) -> UcsStatus,
    pub(crate) mem_unmap: unsafe extern "C" fn(UcpContextH, UcpMemH) -> UcsStatus,
    pub(crate) mem_query: unsafe extern "C" fn(UcpMemH, *mut UcpMemAttr) -> UcsStatus,
    pub(crate) rkey_pack:
        unsafe extern "C" fn(UcpContextH, UcpMemH, *mut *mut c_void, *mut usize) -> UcsStatus,
    pub(crate) rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub(crate) ep_rkey_unpack:
        unsafe extern "C" fn(UcpEpH, *const c_void, *mut UcpRkeyH) -> UcsStatus,
    pub(crate) rkey_destroy: unsafe extern "C" fn(UcpRkeyH),
    pub(crate) put_nbx: unsafe extern "C" fn(
        UcpEpH,
        *const c_void,
        usize,
        u64,
        UcpRkeyH,
        *const UcpRequestParam,
    ) -> UcsStatusPtr,
    pub(crate) request_check_status: unsafe extern "C" fn(*mut c_void) -> UcsStatus,
    pub(crate) request_free: unsafe extern "C" fn(*mut c_void),
    pub(crate) status_string: unsafe extern "C" fn(UcsStatus) -> *const c_char,
}

/// Message for a machine without UCX.
pub(crate) const NEED_LIBUCX: &str = "UCX transport needs libucx (Debian: apt-get install libucx0)";

static API: OnceLock<Result<Api, String>> = OnceLock::new();
static LIBS: OnceLock<(libloading::Library, libloading::Library)> = OnceLock::new();

/// The resolved API, loading the libraries on first use. The error names what is
/// missing and how to install it.
pub(crate) fn api() -> Result<&'static Api, String> {
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Api, String> {
    // SAFETY: loading libucs/libucp runs their ELF constructors, which only set up
    // UCX's own global state (config parser, memory hooks); they have no
    // preconditions on the caller.
    let ucs = unsafe { libloading::Library::new("libucs.so.0") }
        .map_err(|e| format!("{NEED_LIBUCX}: cannot load libucs.so.0: {e}"))?;
    // SAFETY: as above.
    let ucp = unsafe { libloading::Library::new("libucp.so.0") }
        .map_err(|e| format!("{NEED_LIBUCX}: cannot load libucp.so.0: {e}"))?;
    let (ucs, ucp) = {
        let libs = LIBS.get_or_init(|| (ucs, ucp));
        (&libs.0, &libs.1)
    };
    macro_rules! sym {
        ($lib:expr, $name:literal) => {{
            // SAFETY: the field's declared type matches the C prototype in the 1.13
            // headers (see the field list above); the library lives in a static, so
            // the copied function pointer never dangles.
            let s = unsafe { $lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                format!(
                    "{NEED_LIBUCX} (1.13 or newer): missing symbol {}: {e}",
                    $name
                )
            })?;
            *s
        }};
    }
    Ok(Api {
        config_read: sym!(ucp, "ucp_config_read"),
        config_release: sym!(ucp, "ucp_config_release"),
        init_version: sym!(ucp, "ucp_init_version"),
        cleanup: sym!(ucp, "ucp_cleanup"),
        get_version_string: sym!(ucp, "ucp_get_version_string"),
        worker_create: sym!(ucp, "ucp_worker_create"),
        worker_destroy: sym!(ucp, "ucp_worker_destroy"),
        worker_get_address: sym!(ucp, "ucp_worker_get_address"),
        worker_release_address: sym!(ucp, "ucp_worker_release_address"),
        worker_progress: sym!(ucp, "ucp_worker_progress"),
        worker_get_efd: sym!(ucp, "ucp_worker_get_efd"),
        worker_arm: sym!(ucp, "ucp_worker_arm"),
        ep_create: sym!(ucp, "ucp_ep_create"),
        ep_close_nbx: sym!(ucp, "ucp_ep_close_nbx"),
        ep_flush_nbx: sym!(ucp, "ucp_ep_flush_nbx"),
        mem_map: sym!(ucp, "ucp_mem_map"),
        mem_unmap: sym!(ucp, "ucp_mem_unmap"),
        mem_query: sym!(ucp, "ucp_mem_query"),
        rkey_pack: sym!(ucp, "ucp_rkey_pack"),
        rkey_buffer_release: sym!(ucp, "ucp_rkey_buffer_release"),
        ep_rkey_unpack: sym!(ucp, "ucp_ep_rkey_unpack"),
        rkey_destroy: sym!(ucp, "ucp_rkey_destroy"),
        put_nbx: sym!(ucp, "ucp_put_nbx"),
        request_check_status: sym!(ucp, "ucp_request_check_status"),
        request_free: sym!(ucp, "ucp_request_free"),
        status_string: sym!(ucs, "ucs_status_string"),
    })
}

/// `UCS_PTR_IS_ERR`.
pub(crate) fn ptr_is_err(p: UcsStatusPtr) -> bool {
    (p as usize) >= (UCS_ERR_LAST as usize)
}

/// `UCS_PTR_IS_PTR`: a live request handle.
pub(crate) fn ptr_is_ptr(p: UcsStatusPtr) -> bool {
    (p as usize).wrapping_sub(1) < (UCS_ERR_LAST as usize).wrapping_sub(1)
}

/// `UCS_PTR_RAW_STATUS`.
pub(crate) fn ptr_status(p: UcsStatusPtr) -> UcsStatus {
    p as isize as UcsStatus
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    /// Sizes and offsets printed by a C program (`sizeof`/`offsetof`) compiled with
    /// gcc 12 against Debian's libucx-dev 1.13.1 headers on x86_64.
    #[test]
    fn layouts_match_ucx_1_13_headers() {
        assert_eq!(size_of::<UcsStatus>(), 1);
        assert_eq!(size_of::<UcsCpuSet>(), 128);
        assert_eq!(size_of::<UcsSockAddr>(), 16);

        assert_eq!(size_of::<UcpParams>(), 80);
        assert_eq!(offset_of!(UcpParams, features), 8);
        assert_eq!(offset_of!(UcpParams, request_size), 16);
        assert_eq!(offset_of!(UcpParams, tag_sender_mask), 40);
        assert_eq!(offset_of!(UcpParams, mt_workers_shared), 48);
        assert_eq!(offset_of!(UcpParams, estimated_num_eps), 56);
        assert_eq!(offset_of!(UcpParams, name), 72);

        assert_eq!(size_of::<UcpWorkerParams>(), 200);
        assert_eq!(offset_of!(UcpWorkerParams, thread_mode), 8);
        assert_eq!(offset_of!(UcpWorkerParams, cpu_mask), 16);
        assert_eq!(offset_of!(UcpWorkerParams, events), 144);
        assert_eq!(offset_of!(UcpWorkerParams, user_data), 152);
        assert_eq!(offset_of!(UcpWorkerParams, event_fd), 160);
        assert_eq!(offset_of!(UcpWorkerParams, flags), 168);
        assert_eq!(offset_of!(UcpWorkerParams, name), 176);
        assert_eq!(offset_of!(UcpWorkerParams, am_alignment), 184);
        assert_eq!(offset_of!(UcpWorkerParams, client_id), 192);

        assert_eq!(size_of::<UcpErrHandler>(), 16);
        assert_eq!(size_of::<UcpEpParams>(), 104);
        assert_eq!(offset_of!(UcpEpParams, address), 8);
        assert_eq!(offset_of!(UcpEpParams, err_mode), 16);
        assert_eq!(offset_of!(UcpEpParams, err_handler), 24);
        assert_eq!(offset_of!(UcpEpParams, user_data), 40);
        assert_eq!(offset_of!(UcpEpParams, flags), 48);
        assert_eq!(offset_of!(UcpEpParams, sockaddr), 56);
        assert_eq!(offset_of!(UcpEpParams, conn_request), 72);
        assert_eq!(offset_of!(UcpEpParams, name), 80);
        assert_eq!(offset_of!(UcpEpParams, local_sockaddr), 88);

        assert_eq!(size_of::<UcpMemMapParams>(), 40);
        assert_eq!(offset_of!(UcpMemMapParams, address), 8);
        assert_eq!(offset_of!(UcpMemMapParams, length), 16);
        assert_eq!(offset_of!(UcpMemMapParams, flags), 24);
        assert_eq!(offset_of!(UcpMemMapParams, prot), 28);
        assert_eq!(offset_of!(UcpMemMapParams, memory_type), 32);

        assert_eq!(size_of::<UcpMemAttr>(), 32);
        assert_eq!(offset_of!(UcpMemAttr, address), 8);
        assert_eq!(offset_of!(UcpMemAttr, length), 16);
        assert_eq!(offset_of!(UcpMemAttr, mem_type), 24);

        assert_eq!(size_of::<UcpRequestParam>(), 72);
        assert_eq!(offset_of!(UcpRequestParam, flags), 4);
        assert_eq!(offset_of!(UcpRequestParam, request), 8);
        assert_eq!(offset_of!(UcpRequestParam, cb), 16);
        assert_eq!(offset_of!(UcpRequestParam, datatype), 24);
        assert_eq!(offset_of!(UcpRequestParam, user_data), 32);
        assert_eq!(offset_of!(UcpRequestParam, reply_buffer), 40);
        assert_eq!(offset_of!(UcpRequestParam, memory_type), 48);
        assert_eq!(offset_of!(UcpRequestParam, recv_info), 56);
        assert_eq!(offset_of!(UcpRequestParam, memh), 64);
        for a in [
            align_of::<UcpParams>(),
            align_of::<UcpWorkerParams>(),
            align_of::<UcpEpParams>(),
            align_of::<UcpMemMapParams>(),
            align_of::<UcpRequestParam>(),
        ] {
            assert_eq!(a, 8);
        }
    }

    #[test]
    fn status_pointer_classification() {
        assert!(!ptr_is_err(std::ptr::null_mut()));
        assert!(!ptr_is_ptr(std::ptr::null_mut()));
        let err = -25isize as UcsStatusPtr;
        assert!(ptr_is_err(err));
        assert!(!ptr_is_ptr(err));
        assert_eq!(ptr_status(err), -25);
        let req = 0x7f00_1234_5678usize as UcsStatusPtr;
        assert!(ptr_is_ptr(req));
        assert!(!ptr_is_err(req));
    }
}
