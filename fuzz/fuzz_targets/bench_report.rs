#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cmm_cli::fuzz::bench_report(data));
