//! The kernel memory that mappings (VMAs) cost: the slab caches that grow with them
//! (`vm_area_struct`, the maple tree's `maple_node`, and `vma_lock` where a kernel has one), read
//! from `/proc/slabinfo` (root only) before and after a run; where it cannot be read, an estimate
//! per VMA, said to be one.

/// The slab caches a VMA costs memory in.
pub const CACHES: [&str; 3] = ["vm_area_struct", "maple_node", "vma_lock"];

/// Bytes per VMA assumed when `/proc/slabinfo` cannot be read: a `vm_area_struct` (192 bytes
/// on 6.x x86-64 kernels) and a share of a 256-byte maple node (about 10 VMAs per node).
pub const ESTIMATE_BYTES_PER_VMA: u64 = 192 + 256 / 10;

/// Bytes of the objects in use in the slab caches of [`CACHES`] (`active_objs * objsize`):
/// what VMAs added take, though new objects first fill free room in slabs the cache already has.
pub fn slab_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/slabinfo").ok()?;
    parse_slabinfo(&text)
}

fn parse_slabinfo(text: &str) -> Option<u64> {
    let mut total = None;
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.is_empty() || !CACHES.contains(&f[0]) {
            continue;
        }
        // name active_objs num_objs objsize objperslab pagesperslab : tunables ... : slabdata ...
        let active: u64 = f.get(1)?.parse().ok()?;
        let size: u64 = f.get(3)?.parse().ok()?;
        *total.get_or_insert(0) += active * size;
    }
    total
}

/// What a run's mappings cost the kernel, and how it was found.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MappingCost {
    /// KiB (may be negative when the caches shrank: other processes' activity is in it too).
    pub kib: i64,
    /// "slabinfo" (measured), or "estimate: N bytes per VMA".
    pub source: String,
}

impl MappingCost {
    /// From the slab bytes before and after (if both were read), else the estimate for
    /// `vmas_added`.
    pub fn between(before: Option<u64>, after: Option<u64>, vmas_added: i64) -> Self {
        match (before, after) {
            (Some(b), Some(a)) => Self {
                kib: (a as i64 - b as i64) / 1024,
                source: "slabinfo".into(),
            },
            _ => Self {
                kib: vmas_added * ESTIMATE_BYTES_PER_VMA as i64 / 1024,
                source: format!("estimate: {ESTIMATE_BYTES_PER_VMA} bytes per VMA"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "slabinfo - version: 2.1
# name            <active_objs> <num_objs> <objsize> <objperslab> <pagesperslab> : tunables <limit> <batchcount> <sharedfactor> : slabdata <active_slabs> <num_slabs> <sharedavail>
vm_area_struct      2712  10290    192   21    1 : tunables    0    0    0 : slabdata    490    490      0
anon_vma_chain      1350   6656     64   64    1 : tunables    0    0    0 : slabdata    104    104      0
maple_node           993   1824    256   16    2 : tunables    0    0    0 : slabdata    114    114      0
";

    #[test]
    fn the_vma_caches_are_summed_by_their_objects_in_use() {
        assert_eq!(parse_slabinfo(SAMPLE), Some(2712 * 192 + 993 * 256));
        assert_eq!(parse_slabinfo("slabinfo - version: 2.1\n"), None);
    }

    #[test]
    fn measured_or_estimated_and_said_so() {
        let m = MappingCost::between(Some(1 << 20), Some(3 << 20), 5);
        assert_eq!(m.kib, 2048);
        assert_eq!(m.source, "slabinfo");
        let e = MappingCost::between(None, Some(3 << 20), 1024);
        assert_eq!(e.kib, 1024 * ESTIMATE_BYTES_PER_VMA as i64 / 1024);
        assert!(e.source.starts_with("estimate"));
    }

    #[test]
    fn a_thousand_mappings_show_in_the_slabs() {
        let Some(before) = slab_bytes() else {
            eprintln!("/proc/slabinfo is not readable here: only the estimate is tested");
            return;
        };
        // 4000 single-page mappings with alternating protections, so none can merge.
        let len = 4000 * 4096;
        let p = pageone_sys::mmap_anonymous(len).unwrap();
        for i in (0..4000).step_by(2) {
            // SAFETY: a page of the mapping made above, which nothing here reads or writes.
            let r =
                unsafe { pageone_sys::raw_mprotect(p.add(i * 4096).cast(), 4096, libc::PROT_READ) };
            assert_eq!(r, 0);
        }
        let after = slab_bytes().unwrap();
        // SAFETY: mapped above, no reference into it.
        unsafe { pageone_sys::munmap(p, len) }.unwrap();
        // 4000 VMAs of 192 bytes are 750 KiB; allow for other processes' churn.
        assert!(after > before + 400 * 1024, "{before} -> {after}");
    }
}
