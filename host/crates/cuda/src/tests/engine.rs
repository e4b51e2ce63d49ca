//! The engine: both matmul paths, graphs against eager launches, batch changes and tuning.

use super::*;

#[test]
fn both_matmul_paths_compute_the_same_step() {
    let _lock = gpu_lock();
    let Some(mut engine) = tiny_engine(MatmulChoice::Auto) else {
        return;
    };
    let vocab = engine.shape().vocab as usize;
    for batch in [1u32, 3, 8] {
        let start: Vec<u32> = (0..batch).map(|b| 11 + 97 * b).collect();
        let mut logits = Vec::new();
        for path in [MatmulPath::Gemv, MatmulPath::Cublas] {
            engine.set_tokens(&start).unwrap();
            engine.step_eager(batch, path).unwrap();
            let l = engine.logits(batch).unwrap();
            // The step's tokens are the greedy choice over its own logits.
            assert_eq!(
                engine.tokens(batch).unwrap(),
                cpu_argmax(&l, vocab),
                "{path:?} batch {batch}"
            );
            logits.push(floats(&l));
        }
        let err = relative_error(&logits[0], &logits[1]);
        assert!(
            err < 2e-2,
            "batch {batch}: gemv vs cublas logits differ by {err}"
        );
    }
}

#[test]
fn every_step_variant_replayed_as_a_graph_matches_eager_launches() {
    let _lock = gpu_lock();
    let Some(mut engine) = tiny_engine(MatmulChoice::Auto) else {
        return;
    };
    for batch in [2u32, 5, 8] {
        let start: Vec<u32> = (0..batch).map(|b| 5 + 31 * b).collect();
        let variants = engine.variants(batch);
        // Both paths, each with every attention implementation.
        assert_eq!(variants.len(), 2 * AttentionImpl::ALL.len(), "{variants:?}");
        for variant in variants {
            engine.set_tokens(&start).unwrap();
            engine.step_eager(batch, variant.path).unwrap();
            let eager = floats(&engine.logits(batch).unwrap());
            engine.set_tokens(&start).unwrap();
            engine.replay_variant(batch, variant).unwrap();
            let replayed = floats(&engine.logits(batch).unwrap());
            let err = relative_error(&replayed, &eager);
            // Only the order of float atomics in the fused norms may differ.
            assert!(err < 1e-2, "{} batch {batch}: {err}", variant.label());
        }
    }
}

#[test]
fn a_prepared_graph_steps_and_reports_its_time() {
    let _lock = gpu_lock();
    for matmul in [MatmulChoice::Gemv, MatmulChoice::Cublas] {
        let Some(mut engine) = tiny_engine(matmul) else {
            return;
        };
        let path = if matmul == MatmulChoice::Gemv {
            MatmulPath::Gemv
        } else {
            MatmulPath::Cublas
        };
        let info = engine.prepare(3).unwrap().clone();
        assert_eq!(info.variant.path, path);
        engine.set_tokens(&[1, 2, 3]).unwrap();
        engine.launch_step(3).unwrap();
        let done = engine.drain().unwrap();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].batch, 3);
        assert!(done[0].gpu_ms > 0.0);
        let logits = engine.logits(3).unwrap();
        assert_eq!(
            engine.tokens(3).unwrap(),
            cpu_argmax(&logits, engine.shape().vocab as usize)
        );
    }
}

#[test]
fn batch_size_changes_between_steps_without_reallocation() {
    let _lock = gpu_lock();
    let Some(mut engine) = tiny_engine(MatmulChoice::Auto) else {
        return;
    };
    let vocab = engine.shape().vocab;
    let mut seen = Vec::new();
    for batch in [1u32, 3, 8, 3, 1, 7] {
        engine.launch_step(batch).unwrap();
        seen.extend(engine.drain().unwrap().into_iter().map(|d| d.batch));
        assert!(engine.tokens(batch).unwrap().iter().all(|&t| t < vocab));
        let info = engine.graph_info(batch).unwrap();
        assert_eq!(
            info.attention,
            AttentionSplit::plan(engine.shape(), batch, 100, engine.gpu().sms)
        );
        // Both matmul paths, each with every attention implementation.
        let timed = &info.candidates_ms;
        assert_eq!(timed.len(), 2 * AttentionImpl::ALL.len(), "{timed:?}");
        assert!(timed.iter().any(|(v, _)| v.path == MatmulPath::Gemv));
        assert!(timed.iter().any(|(v, _)| v.path == MatmulPath::Cublas));
        assert!(timed.iter().all(|(_, ms)| *ms > 0.0));
    }
    assert_eq!(seen, [1, 3, 8, 3, 1, 7]);
    let err = engine.launch_step(9).unwrap_err().to_string();
    assert!(err.contains("batch size 9 is out of range"), "{err}");
}

#[test]
fn nearest_tuning_times_once_then_reuses_the_nearest_choice() {
    let _lock = gpu_lock();
    let Some(mut tuned) = tiny_engine(MatmulChoice::Auto) else {
        return;
    };
    let shape = tuned.shape().clone();
    let Some(mut engine) = tiny_engine_with(EngineOptions {
        tuning: Tuning::Nearest,
        ..EngineOptions::default()
    }) else {
        return;
    };
    let first = engine.prepare(2).unwrap().clone();
    assert_eq!(first.chosen_for, None);
    assert_eq!(
        first.candidates_ms.len(),
        2 * AttentionImpl::ALL.len(),
        "{first:?}"
    );
    // Only timed choices are handed on: every later size takes batch 2's.
    for batch in [3u32, 8, 1] {
        let info = engine.prepare(batch).unwrap().clone();
        assert_eq!(info.chosen_for, Some(2), "batch {batch}");
        assert_eq!(info.variant, first.variant, "batch {batch}");
        assert!(
            info.candidates_ms.is_empty(),
            "batch {batch}: nothing timed"
        );
        assert_eq!(
            info.attention,
            AttentionSplit::plan(&shape, batch, 100, engine.gpu().sms),
            "the split still fits the batch size"
        );
    }
    // Same weights, same input: the reused variant computes what a fully tuned engine does
    // (up to the rounding of whichever variant each chose).
    let vocab = shape.vocab as usize;
    let mut logits = Vec::new();
    for e in [&mut engine, &mut tuned] {
        // Tuning replays the step, which rewrites the tokens: prepare first.
        e.prepare(3).unwrap();
        e.set_tokens(&[5, 6, 7]).unwrap();
        e.launch_step(3).unwrap();
        e.drain().unwrap();
        let l = e.logits(3).unwrap();
        assert_eq!(e.tokens(3).unwrap(), cpu_argmax(&l, vocab));
        logits.push(floats(&l));
    }
    let err = relative_error(&logits[0], &logits[1]);
    assert!(err < 2e-2, "nearest vs fully tuned logits differ by {err}");
}

#[test]
fn a_model_larger_than_the_gpu_is_refused_with_the_sizes() {
    let _lock = gpu_lock();
    let shape = ModelShape::preset("llama-3.1-70b").unwrap();
    match Engine::new(&shape, 1024, 64, 0, EngineOptions::default()) {
        Err(CudaError::OutOfMemory {
            what,
            needed_bytes,
            free_bytes,
        }) => {
            assert!(needed_bytes > free_bytes);
            assert!(what.contains("llama-3.1-70b"), "{what}");
        }
        // The memory rule the simulator shares refuses it before anything is allocated
        // (on an H200: 141.1 GB of weights, 135.1 GB usable).
        Err(CudaError::Config(message)) => {
            assert!(
                message.contains("llama-3.1-70b") && message.contains("does not fit"),
                "{message}"
            );
            assert!(message.contains("GB"), "the sizes are named: {message}");
        }
        Err(error) if no_cuda(&error) => {
            tokwatt_test_support::skip_gpu(format_args!("no CUDA driver: {error}"));
        }
        Err(error) => panic!("expected the memory rule or out of memory, got {error}"),
        Ok(engine) => {
            let (_, total) = engine.gpu().memory().unwrap();
            assert!(
                total > shape.weight_bytes(),
                "a GPU that holds 141 GB of weights"
            );
        }
    }
}
