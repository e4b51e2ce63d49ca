//! The workload end to end: construction without a driver, and decoding on its own thread.

use super::*;

#[test]
fn without_a_driver_construction_fails_cleanly() {
    // SAFETY: only tries to dlopen libcuda.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("not applicable: a CUDA driver is present; this checks machines without one");
        return;
    }
    let config = CudaDecodeConfig::new(tiny_shape(64, 4, 2), 100, 4);
    let err = CudaDecode::new(config).unwrap_err().to_string();
    assert!(
        err.starts_with("CUDA driver not found (libcuda.so): "),
        "{err}"
    );
}

#[test]
fn the_workload_decodes_on_its_own_thread_and_follows_the_batch_size() {
    let _lock = gpu_lock();
    let mut config = CudaDecodeConfig::new(tiny_shape(64, 4, 2), 100, 4);
    config.batch_size = 2;
    let mut decode = match CudaDecode::new(config) {
        Ok(decode) => decode,
        Err(error) if no_cuda(&error) => {
            return tokwatt_test_support::skip_gpu(format_args!("no CUDA driver: {error}"));
        }
        Err(error) => panic!("{error}"),
    };
    assert_eq!(decode.name(), "cuda-decode");
    assert_eq!((decode.batch_size_max(0), decode.batch_size(0)), (4, 2));
    // Wait (boundedly) for steps rather than assuming how long they take.
    let wait_for_steps = |decode: &mut CudaDecode| {
        for _ in 0..6000 {
            let window = decode.read_window(0).unwrap();
            if window.steps > 0 {
                return window;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("no decode step finished within a minute");
    };
    let first = wait_for_steps(&mut decode);
    assert_eq!(first.tokens, 2 * first.steps);
    assert_eq!(
        (first.active_sequences, first.batch_size, first.queue_depth),
        (2, 2, 0)
    );
    assert!(first.tpot_p50_ms > 0.0 && first.tpot_p99_ms >= first.tpot_p50_ms);

    decode.set_batch_size(0, 3).unwrap();
    assert_eq!(decode.batch_size(0), 3);
    // Steps queued at batch 2 may still land in the next windows; then only batch 3 remains.
    let mut only_threes = false;
    for _ in 0..6000 {
        let window = decode.read_window(0).unwrap();
        assert!(
            window.tokens >= 2 * window.steps && window.tokens <= 3 * window.steps,
            "{window:?}"
        );
        if window.steps > 0 && window.tokens == 3 * window.steps && window.batch_size == 3 {
            only_threes = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(only_threes, "no window of batch-3 steps within a minute");

    assert!(matches!(
        decode.set_batch_size(0, 5),
        Err(WorkloadError::BatchOutOfRange {
            requested: 5,
            max: 4
        })
    ));
    assert!(matches!(
        decode.set_batch_size(1, 2),
        Err(WorkloadError::NoSuchGpu { index: 1, count: 1 })
    ));
    assert!(matches!(
        decode.read_window(1),
        Err(WorkloadError::NoSuchGpu { .. })
    ));
    drop(decode); // joins the thread
}
