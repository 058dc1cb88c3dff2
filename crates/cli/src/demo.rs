//! `pageone demo`: the main job. Fills real memory with duplicate data, lets the in-process engine
//! merge it while showing progress, and prints what the kernel says was saved.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use pageone_engine::Engine;
use pageone_seed::{fill_page, Data};
use pageone_sys as sys;

const PAGE: usize = 4096;

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

pub fn run(total_mib: usize, copies: usize, workers: usize, hard: bool) -> Result<()> {
    if copies < 2 {
        bail!("--copies must be at least 2 to have duplicates");
    }
    let region = (total_mib / copies).max(1) << 20;
    let data = if hard { Data::Hard } else { Data::Easy };
    let engine = Engine::builder()
        .workers(workers)
        .merge_period(Duration::from_millis(100))
        .build()
        .context("the pageone engine could not start on this kernel")?;
    println!(
        "pageone demo: {copies} regions x {} MiB of identical \"{data}\" data, 1 in 8 pages zero; \
         watch mode {}",
        region >> 20,
        engine.watch_mode()
    );
    let avail0 = sys::meminfo_kib("MemAvailable")?;
    // Fill first, then register (like a VM whose memory is already in use): the "before"
    // figures are then measured before anything merged.
    let mut regions = Vec::new();
    for _ in 0..copies {
        let r = sys::mmap_anonymous(region).context("could not map memory for the demo")?;
        for i in 0..region / PAGE {
            // SAFETY: page i of a fresh private mapping owned by this function.
            unsafe {
                if i % 8 == 7 {
                    // A zero page that was written (a zeroed buffer): it uses memory.
                    std::ptr::write_volatile(r.add(i * PAGE), 0);
                } else {
                    fill_page(r.add(i * PAGE), data, i as u64);
                }
            }
        }
        regions.push(r);
    }
    let avail1 = sys::meminfo_kib("MemAvailable")?;
    let pss1 = sys::self_smaps_rollup_kib("Pss")?;
    let pages = region / PAGE;
    let zero = (pages / 8) as u64 * copies as u64;
    let possible = (pages - pages / 8) as u64 * (copies as u64 - 1) + zero;
    println!(
        "filled {} MiB: MemAvailable {:.0} MiB ({:.0} MiB used), process Pss {:.0} MiB",
        (region * copies) >> 20,
        mib(avail1),
        mib(avail0.saturating_sub(avail1)),
        mib(pss1)
    );
    println!(
        "possible saving: {:.0} MiB; registering the regions and merging...",
        (possible * PAGE as u64) as f64 / 1048576.0
    );
    let t0 = Instant::now();
    for &r in &regions {
        engine.register(r, region)?;
    }
    let mut last = Instant::now() - Duration::from_secs(1);
    // Progress stops for good when merges wait for VMAs: no need to wait out the minute then.
    let (mut best, mut best_at) = (0, Instant::now());
    loop {
        let s = engine.stats();
        let saved = s.pages_sharing + s.zero_pages;
        if saved > best {
            (best, best_at) = (saved, Instant::now());
        }
        let stuck = s.vma_limited_merges > 0 && best_at.elapsed() > Duration::from_secs(5);
        let done = saved * 100 >= possible * 99 || stuck;
        if last.elapsed() >= Duration::from_millis(250) || done {
            println!(
                "  {:5.2}s  saved {:7.1} MiB ({:5.1}%)  shared {:7} sharing {:7} zero {:7}",
                t0.elapsed().as_secs_f64(),
                (saved * PAGE as u64) as f64 / 1048576.0,
                saved as f64 * 100.0 / possible as f64,
                s.pages_shared,
                s.pages_sharing,
                s.zero_pages
            );
            last = Instant::now();
        }
        if done || t0.elapsed() > Duration::from_secs(60) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = t0.elapsed();
    let avail2 = sys::meminfo_kib("MemAvailable")?;
    let pss2 = sys::self_smaps_rollup_kib("Pss")?;
    let s = engine.stats();
    println!(
        "merged in {:.2}s using {:.2} CPU-seconds of the engine's threads",
        elapsed.as_secs_f64(),
        s.worker_cpu_ns as f64 / 1e9
    );
    println!(
        "MemAvailable {:.0} -> {:.0} MiB (+{:.0} MiB); process Pss {:.0} -> {:.0} MiB (-{:.0} MiB)",
        mib(avail1),
        mib(avail2),
        mib(avail2.saturating_sub(avail1)),
        mib(pss1),
        mib(pss2),
        mib(pss1.saturating_sub(pss2))
    );
    println!("stats: {}", serde_json::to_string_pretty(&s)?);
    if let Some(n) = s.max_map_count_to_merge() {
        println!(
            "the process reached its mapping limit (vm.max_map_count = {}): {} pages wait to \
             merge; sysctl -w vm.max_map_count={n} would let them",
            s.vma_limit, s.pages_waiting_on_limit
        );
    }
    // Every byte is still what was written.
    for &r in &regions {
        // SAFETY: the region is mapped and only this thread accesses it; the engine never
        // changes its contents.
        let r = unsafe { std::slice::from_raw_parts(r, region) };
        for (i, p) in r.chunks(PAGE).enumerate() {
            let mut want = [0u8; PAGE];
            if i % 8 != 7 {
                // SAFETY: `want` is a local page.
                unsafe { fill_page(want.as_mut_ptr(), data, i as u64) };
            }
            if p != want {
                bail!("page {i} does not hold what was written: this is a bug, please report it");
            }
        }
    }
    println!("verified: every page still holds what was written");
    for &r in &regions {
        engine.unregister(r, region)?;
        // SAFETY: mapped above; no reference into it remains.
        unsafe { sys::munmap(r, region)? };
    }
    engine.shutdown();
    Ok(())
}
