//! The seed's page data sets: what the demo, the cross-process test clients (`pageone
//! scope-client`) and the benchmarks fill memory with.
//!
//! Page `i` of either set holds one 8-byte value, distinct per `i`, in an otherwise zero page:
//! at offset 0 in the "easy" set, at a pseudo-random offset in 0..253 in the "hard" set (a mean
//! of ~128 leading zero bytes, which is what makes a byte-ordered index compare long prefixes).
//! The same `i` gives the same bytes in every process and run, so regions filled alike are
//! identical across regions and unique within.

/// The seed data sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Data {
    Easy,
    Hard,
}

impl std::fmt::Display for Data {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Data::Easy => "easy",
            Data::Hard => "hard",
        })
    }
}

/// A small, fast, seeded generator (xorshift64*), so every run and both sides see the same bytes.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// Writes page `i` of data set `data` at `page` (4096 bytes, already zero).
///
/// # Safety
/// `page` must be valid for writes of 4096 bytes and not otherwise accessed meanwhile.
pub unsafe fn fill_page(page: *mut u8, data: Data, i: u64) {
    let v = mix(i.wrapping_add(0x9E37_79B9_7F4A_7C15)) | 1; // nonzero, distinct per i w.h.p.
    let v = (v & !0xFFFF_FFFF) | i; // and certainly distinct (low half = index)
    let off = match data {
        Data::Easy => 0,
        Data::Hard => (mix(i ^ 0xABCD) % 253) as usize,
    };
    // SAFETY: off + 8 <= 260 < 4096, inside the page the caller vouches for.
    unsafe { std::ptr::copy_nonoverlapping(v.to_le_bytes().as_ptr(), page.add(off), 8) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(data: Data, i: u64) -> Vec<u8> {
        let mut p = vec![0u8; 4096];
        // SAFETY: `p` is a local buffer of 4096 bytes.
        unsafe { fill_page(p.as_mut_ptr(), data, i) };
        p
    }

    #[test]
    fn one_nonzero_word_where_the_set_puts_it() {
        for i in 0..2000 {
            let e = page(Data::Easy, i);
            assert!(e[8..].iter().all(|&b| b == 0), "easy page {i}");
            assert_ne!(e[..8], [0; 8]);
            let h = page(Data::Hard, i);
            let first = h.iter().position(|&b| b != 0).expect("a nonzero byte");
            assert!(first < 253 + 8, "hard page {i} starts at {first}");
            assert!(h[first + 8..].iter().all(|&b| b == 0), "hard page {i}");
        }
    }

    #[test]
    fn same_index_same_bytes_and_distinct_pages() {
        assert_eq!(page(Data::Hard, 77), page(Data::Hard, 77));
        let mut seen = std::collections::HashSet::new();
        for i in 0..4096 {
            assert!(seen.insert(page(Data::Easy, i)), "easy page {i} repeats");
        }
        // Hard pages put their value at offsets spread over 0..253 (mean near 126).
        let offsets: Vec<usize> = (0..4096)
            .map(|i| page(Data::Hard, i).iter().position(|&b| b != 0).unwrap())
            .collect();
        let mean = offsets.iter().sum::<usize>() as f64 / offsets.len() as f64;
        assert!((100.0..150.0).contains(&mean), "mean offset {mean}");
    }
}
