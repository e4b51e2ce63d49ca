//! Serving engines as tokwatt workloads: the token counter and time-per-token histogram of a
//! server that already runs (vLLM, SGLang, TGI, TensorRT-LLM, llama.cpp, or named metrics), read over
//! plain HTTP on a thread of its own.

pub mod prometheus;
