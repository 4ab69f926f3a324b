//! The host mirror of the device page checksum's arithmetic (`cuda/checksum.cu`):
//! CRC-32C of chunks joined with zlib's `crc32_combine` (multiplication by
//! `x^(8n) mod P` in GF(2)\[x\]/P, reflected bit order). The kernel's chunking is
//! reproduced exactly, so the tests here check the formulas the kernel uses against
//! the `crc32c` crate on the host; the GPU check compares the kernel itself.

/// CRC-32C's reflected polynomial (Castagnoli).
pub const POLY: u32 = 0x82F6_3B78;

/// `a * b mod P` (bit 31 is `x^0`).
pub fn multmodp(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        if m == 0 {
            break; // a == 0
        }
    }
    p
}

/// `x^(2^k) mod P` for `k < 32`.
pub fn x2n_table() -> [u32; 32] {
    let mut t = [0u32; 32];
    let mut p = 1u32 << 30;
    t[0] = p;
    for e in t.iter_mut().skip(1) {
        p = multmodp(p, p);
        *e = p;
    }
    t
}

/// `x^(8 n) mod P`.
pub fn x8nmodp(mut n: u64, x2n: &[u32; 32]) -> u32 {
    let mut p = 1u32 << 31;
    let mut k = 3usize;
    while n != 0 {
        if n & 1 != 0 {
            p = multmodp(x2n[k & 31], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

/// Standard CRC-32C of `a ++ b` from the CRCs of `a` and `b` and `b`'s length.
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64, x2n: &[u32; 32]) -> u32 {
    multmodp(x8nmodp(len_b, x2n), crc_a) ^ crc_b
}

/// Byte-wise CRC-32C (init and final xor `0xFFFFFFFF`), as each device thread.
pub fn crc32c_bytewise(data: &[u8]) -> u32 {
    let mut table = [0u32; 256];
    for (i, e) in table.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
        }
        *e = c;
    }
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c = table[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8);
    }
    c ^ 0xFFFF_FFFF
}

/// The kernel's whole computation for one page with `threads` threads: equal
/// chunks of `ceil(len / threads)` bytes, each CRC'd alone, joined in order.
pub fn chunked_crc32c(data: &[u8], threads: usize) -> u32 {
    let x2n = x2n_table();
    let len = data.len();
    let chunk = len.div_ceil(threads);
    let piece = |t: usize| {
        let lo = (t * chunk).min(len);
        &data[lo..(lo + chunk).min(len)]
    };
    let mut crc = crc32c_bytewise(piece(0));
    for t in 1..threads {
        let p = piece(t);
        if p.is_empty() {
            break;
        }
        crc = combine(crc, crc32c_bytewise(p), p.len() as u64, &x2n);
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn chunked_crc_equals_the_crc32c_crate() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
        // The default model's page (288,000 bytes), odd sizes, sizes below the
        // thread count (empty chunks) and the empty page.
        for len in [288_000usize, 4096, 1000, 257, 255, 31, 1, 0] {
            let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            for threads in [256, 128, 7, 1] {
                assert_eq!(
                    chunked_crc32c(&data, threads),
                    crc32c::crc32c(&data),
                    "len {len}, threads {threads}"
                );
            }
        }
    }

    #[test]
    fn multiplication_by_one_is_identity_and_a_flipped_byte_changes_the_crc() {
        assert_eq!(multmodp(1 << 31, 0xDEAD_BEEF), 0xDEAD_BEEF);
        assert_eq!(multmodp(0, 0xDEAD_BEEF), 0);
        let mut data = vec![7u8; 10_000];
        let a = chunked_crc32c(&data, 256);
        data[5_000] ^= 1;
        assert_ne!(a, chunked_crc32c(&data, 256));
    }
}
