use pageone_engine::Engine;
use std::time::Duration;

#[test]
fn smoke() {
    let e = Engine::builder()
        .merge_period(Duration::from_millis(20))
        .build()
        .unwrap();
    let mut r = e.alloc_region(4 * 1024 * 4096).unwrap();
    let s = r.as_mut_slice();
    for (i, p) in s.chunks_mut(4096).enumerate() {
        if i % 4 != 3 {
            p[..8].copy_from_slice(&((i / 4 % 512) as u64 + 1).to_le_bytes());
        }
    }
    assert!(e.wait_periods(6, Duration::from_secs(20)));
    println!("{:#?}", e.stats());
    let s = r.as_mut_slice();
    for (i, p) in s.chunks_mut(4096).enumerate() {
        let want = if i % 4 != 3 {
            (i / 4 % 512) as u64 + 1
        } else {
            0
        };
        assert_eq!(u64::from_le_bytes(p[..8].try_into().unwrap()), want);
        assert!(p[8..].iter().all(|&b| b == 0));
    }
    s[4096 * 5] = 77;
    assert_eq!(s[4096 * 5], 77);
    assert!(e.wait_periods(2, Duration::from_secs(20)));
    println!("{:#?}", e.stats());
    drop(r);
    println!("{:#?}", e.stats());
}
