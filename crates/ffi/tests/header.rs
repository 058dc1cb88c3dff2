//! `include/pageone.h` must be what cbindgen generates from the crate: this test fails when the
//! committed header is stale, and rewrites it when run with `PAGEONE_BLESS=1`.

use std::path::Path;

#[test]
fn header_is_up_to_date() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = crate_dir.join("../../include/pageone.h");
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("crates/ffi/cbindgen.toml is readable");
    // Parsing the one source file needs no `cargo metadata` (and no nested cargo).
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);

    if std::env::var_os("PAGEONE_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&header, &generated).expect("include/pageone.h is writable");
        return;
    }
    let committed = std::fs::read(&header).unwrap_or_default();
    if committed != generated {
        panic!(
            "include/pageone.h is stale: it differs from what cbindgen generates from \
             crates/ffi/src/lib.rs.\nRegenerate it with\n    \
             PAGEONE_BLESS=1 cargo test -p pageone-ffi --test header\nand commit it.\n\
             --- generated ---\n{}",
            String::from_utf8_lossy(&generated)
        );
    }
}
