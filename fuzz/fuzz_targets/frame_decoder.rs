//! The frame decoder on any bytes: as a frame body, decoding never panics and what decodes
//! encodes back to the same bytes; as a stream on a socket, frames are read until an error,
//! none longer than the limit.

#![no_main]

use std::io::Write;
use std::os::unix::net::UnixStream;

use libfuzzer_sys::fuzz_target;
use pageone_proto::{read_frame, Reply, Request, MAX_FRAME};

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = Request::decode(data) {
        assert_eq!(&r.encode()[4..], data, "{r:?} does not encode back");
    }
    if let Ok(r) = Reply::decode(data) {
        assert_eq!(&r.encode()[4..], data, "{r:?} does not encode back");
    }
    let (a, mut b) = UnixStream::pair().expect("a socket pair");
    // (Inputs are far smaller than a socket's buffer: the write does not wait.)
    if data.len() <= 64 << 10 {
        b.write_all(data).expect("write to the pair");
        drop(b);
        let mut read = 0;
        while let Ok((body, _)) = read_frame(&a) {
            assert!(body.len() <= MAX_FRAME);
            read += 4 + body.len();
            let _ = Request::decode(&body);
        }
        assert!(read <= data.len());
    }
});
