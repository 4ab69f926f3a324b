//! The per-page checksum of a KV transfer (I4): the prefill node computes it over the
//! bytes it writes, the decode node over the bytes that landed, and the commit is
//! refused on any difference.

/// CRC-32C (Castagnoli polynomial, RFC 3720 §12.1) of a page's transfer bytes. 0 when
/// the integrity-overhead benchmark turned checks off
/// ([`tessera_kernels::attention::set_integrity_checks_for_benchmark`]).
pub fn page_checksum(bytes: &[u8]) -> u32 {
    if tessera_kernels::attention::integrity_checks() {
        crc32c::crc32c(bytes)
    } else {
        0
    }
}
