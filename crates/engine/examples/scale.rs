//! Quick scale check: `cargo run --release -p pageone-engine --example scale -- [regions] [mib] [hard]`.
use std::time::{Duration, Instant};
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let regions: usize = a.get(1).and_then(|s| s.parse().ok()).unwrap_or(4);
    let mib: usize = a.get(2).and_then(|s| s.parse().ok()).unwrap_or(512);
    let hard = a.get(3).is_some_and(|s| s == "hard");
    let e = pageone_engine::Engine::builder()
        .merge_period(Duration::from_millis(100))
        .build()
        .unwrap();
    let len = mib << 20;
    let mut ptrs = vec![];
    for _ in 0..regions {
        let p = pageone_sys::mmap_anonymous(len).unwrap();
        for i in 0..len / 4096 {
            let v = (i as u64 + 1).wrapping_mul(0x9E3779B97F4A7C15) | 1;
            let off = if hard { (i * 7919) % 253 } else { 0 };
            unsafe {
                std::ptr::copy_nonoverlapping(v.to_le_bytes().as_ptr(), p.add(i * 4096 + off), 8)
            };
        }
        ptrs.push(p);
    }
    let possible = ((regions - 1) * len / 4096) as u64;
    let t0 = Instant::now();
    for &p in &ptrs {
        e.register(p, len).unwrap();
    }
    loop {
        let s = e.stats();
        if s.pages_sharing * 100 >= possible * 99 || t0.elapsed() > Duration::from_secs(60) {
            println!(
                "{:.3}s cpu {:.3}s {:?}",
                t0.elapsed().as_secs_f64(),
                s.worker_cpu_ns as f64 / 1e9,
                s
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
