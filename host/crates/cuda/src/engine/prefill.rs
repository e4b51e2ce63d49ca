//! Prefill: chunks of prompts, one per sequence, run through every layer as the rows of one
//! matrix: cuBLAS GEMMs for the projections, a flash-style causal attention on tensor cores
//! (`flash_prefill_hd*` in `kernels.cu`), and the chunk's keys and values written to its
//! sequence's KV cache slot, where later chunks and decode steps read them.
//!
//! A chunk that ends its prompt also gets its first generated token (greedy, from the last
//! row's logits), written as its slot's next decode input: a sequence goes from prefill to
//! decode without a trip through the host.

use cudarc::driver::CudaSlice;

use super::Engine;
use crate::device::{Arg, FLASH_PREFILL_THREADS, PrefillAttention, int};
use crate::error::CudaError;
use crate::shape::BYTES_PER_ELEMENT;

/// Most prompt tokens one prefill call takes (the rows of its activations; the SiLU kernel's
/// grid puts them on y, at most 65 535).
pub const MAX_PREFILL_ROWS: u32 = 32_768;

/// One sequence's part of a prefill call: prompt positions `[start, start + len)` of KV cache
/// slot `slot`, attending to every position before them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillChunk {
    /// KV cache slot of the sequence, below [`Engine::batch_max`].
    pub slot: u32,
    /// Position of the chunk's first token: the prompt tokens prefilled before it.
    pub start: u32,
    /// Tokens in the chunk, at least 1.
    pub len: u32,
    /// The chunk ends its prompt: its next token is computed and becomes the slot's next
    /// decode input.
    pub ends_prompt: bool,
}

/// A decoding sequence's row in a serving step: the token its slot generated last goes in at
/// `position`, and its next token comes out as the slot's next input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeInput {
    pub slot: u32,
    pub position: u32,
}

/// Activations for up to `rows` prompt tokens in `chunks` chunks, allocated on first use and
/// grown when a larger call comes.
#[derive(Debug)]
pub(super) struct PrefillBuffers {
    rows: u32,
    chunks: u32,
    tokens: CudaSlice<u32>,
    x: CudaSlice<u16>,
    x_norm: CudaSlice<u16>,
    sumsq: CudaSlice<f32>,
    qkv: CudaSlice<u16>,
    attn: CudaSlice<u16>,
    gate_up: CudaSlice<u16>,
    act: CudaSlice<u16>,
    /// `PREFILL_DESC` ints per chunk: first row, length, start, slot.
    descriptors: CudaSlice<i32>,
    /// The last row of each chunk that ends its prompt, then those chunks' slots.
    emit: CudaSlice<i32>,
    /// (row, slot) of each decoding sequence's row.
    decode_pairs: CudaSlice<i32>,
    head_x: CudaSlice<u16>,
    head_norm: CudaSlice<u16>,
    logits: CudaSlice<u16>,
    next: CudaSlice<u32>,
}

/// Ints per chunk descriptor (must match `PREFILL_DESC`).
const DESCRIPTOR_INTS: usize = 4;

impl Engine {
    /// Enqueues the prefill of `chunks` (without waiting); `tokens` holds each chunk's prompt
    /// token ids, chunk after chunk. A slot appears at most once per call.
    pub fn prefill(&mut self, chunks: &[PrefillChunk], tokens: &[u32]) -> Result<(), CudaError> {
        self.serve_step(&[], chunks, tokens)
    }

    /// Enqueues one serving step (without waiting): a row for each decoding sequence, whose
    /// input is the token its slot generated last, then the prompt chunks, with `tokens`
    /// holding their token ids chunk after chunk. Every decoding row, and every chunk that
    /// ends its prompt, writes its slot's next token. A slot appears at most once per step.
    pub fn serve_step(
        &mut self,
        decodes: &[DecodeInput],
        prompts: &[PrefillChunk],
        tokens: &[u32],
    ) -> Result<(), CudaError> {
        let chunks: Vec<PrefillChunk> = decodes
            .iter()
            .map(|d| PrefillChunk {
                slot: d.slot,
                start: d.position,
                len: 1,
                ends_prompt: true,
            })
            .chain(prompts.iter().copied())
            .collect();
        let n_decodes = decodes.len() as u32;
        let rows = self.check_prefill(&chunks, n_decodes, tokens)?;
        self.ensure_prefill_buffers(rows, chunks.len() as u32)?;
        let mut descriptors = Vec::with_capacity(chunks.len() * DESCRIPTOR_INTS);
        let mut last_rows = Vec::new();
        let mut emit_slots = Vec::new();
        let mut decode_pairs = Vec::with_capacity(2 * decodes.len());
        let mut row0 = 0u32;
        for (index, chunk) in chunks.iter().enumerate() {
            for value in [row0, chunk.len, chunk.start, chunk.slot] {
                descriptors.push(to_i32(value)?);
            }
            if index < decodes.len() {
                decode_pairs.extend([to_i32(row0)?, to_i32(chunk.slot)?]);
            }
            if chunk.ends_prompt {
                last_rows.push(to_i32(row0 + chunk.len - 1)?);
                emit_slots.push(to_i32(chunk.slot)?);
            }
            row0 += chunk.len;
        }
        let emits = last_rows.len() as u32;
        let mut emit = last_rows;
        emit.extend_from_slice(&emit_slots);
        // Decoding rows' ids are filled in on the GPU from their slots' last tokens.
        let mut row_tokens = vec![0u32; decodes.len()];
        row_tokens.extend_from_slice(tokens);
        let longest_prompt = prompts.iter().map(|c| c.len).max().unwrap_or(0);
        let n_prompts = prompts.len() as u32;
        {
            let Some(b) = self.prefill_buffers.as_mut() else {
                return Err(CudaError::Config("prefill buffers are missing".into()));
            };
            self.gpu.upload(&row_tokens, &mut b.tokens)?;
            self.gpu.upload(&descriptors, &mut b.descriptors)?;
            if !emit.is_empty() {
                self.gpu.upload(&emit, &mut b.emit)?;
            }
            if !decode_pairs.is_empty() {
                self.gpu.upload(&decode_pairs, &mut b.decode_pairs)?;
            }
        }
        let Some(b) = self.prefill_buffers.as_ref() else {
            return Err(CudaError::Config("prefill buffers are missing".into()));
        };
        let g = &self.gpu;
        let s = &self.shape;
        let w = g.addr(&self.weights, 0);
        let wt = |offset: u64| w + offset * BYTES_PER_ELEMENT;
        let (hidden, mlp, vocab) = (s.hidden, s.mlp, s.vocab);
        let (qkv_dim, q_dim) = (s.qkv_dim(), s.q_dim());
        let (x, x_norm, qkv, attn) = (
            g.addr(&b.x, 0),
            g.addr(&b.x_norm, 0),
            g.addr(&b.qkv, 0),
            g.addr(&b.attn, 0),
        );
        let (gate_up, act) = (g.addr(&b.gate_up, 0), g.addr(&b.act, 0));
        let descriptors = g.addr(&b.descriptors, 0);
        // The prompt chunks' descriptors follow the decoding rows'.
        let prompt_descriptors = descriptors + u64::from(n_decodes) * DESCRIPTOR_INTS as u64 * 4;
        let flash = |tiling: PrefillAttention| {
            g.kernels.flash_prefill(s.head_dim, tiling).ok_or_else(|| {
                CudaError::Config(format!(
                    "no prefill attention kernel for head_dim {} with tiling {}",
                    s.head_dim,
                    tiling.name()
                ))
            })
        };
        // Decoding rows are chunks of one row: the tiling of 16 rows per warp wastes least.
        let parts = [
            (n_decodes, 1, descriptors, PrefillAttention::M1N64),
            (
                n_prompts,
                longest_prompt,
                prompt_descriptors,
                self.options.prefill_attention,
            ),
        ];
        let scale_log2 = std::f32::consts::LOG2_E / (s.head_dim as f32).sqrt();
        let log2_theta = s.rope_theta.log2() as f32;

        if n_decodes > 0 {
            g.launch(
                &g.kernels.slot_tokens_in,
                (1, 1, 1),
                256,
                0,
                &[
                    Arg::Ptr(g.addr(&self.buffers.tokens, 0)),
                    Arg::Ptr(g.addr(&b.decode_pairs, 0)),
                    int(n_decodes, "decoding rows")?,
                    Arg::Ptr(g.addr(&b.tokens, 0)),
                ],
            )?;
        }
        g.launch(
            &g.kernels.embed,
            (rows, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(g.addr(&b.tokens, 0)),
                Arg::Ptr(wt(self.layout.embedding)),
                Arg::Ptr(x),
                Arg::Ptr(g.addr(&b.sumsq, 0)),
                int(hidden, "hidden")?,
                int(vocab, "vocab")?,
            ],
        )?;
        for (layer, offsets) in self.layout.layers.iter().enumerate() {
            let (Some(k), Some(v)) = (self.k_cache.get(layer), self.v_cache.get(layer)) else {
                return Err(CudaError::Config(format!("layer {layer} has no KV cache")));
            };
            // The norms' weights are folded into the projections after them (exactly 1 here).
            self.rmsnorm(rows, x, wt(offsets.attn_norm), x_norm)?;
            g.gemm(
                qkv_dim,
                rows,
                hidden,
                wt(offsets.qkv),
                x_norm,
                hidden,
                qkv,
                qkv_dim,
                false,
            )?;
            for &(count, longest, descriptors, tiling) in &parts {
                if count == 0 {
                    continue;
                }
                g.launch(
                    &g.kernels.prefill_rope_kv,
                    (longest, count, 1),
                    128,
                    0,
                    &[
                        Arg::Ptr(qkv),
                        int(qkv_dim, "qkv width")?,
                        int(s.heads, "heads")?,
                        int(s.kv_heads, "kv heads")?,
                        int(s.head_dim, "head_dim")?,
                        Arg::Ptr(descriptors),
                        Arg::Ptr(g.addr(k, 0)),
                        Arg::Ptr(g.addr(v, 0)),
                        int(self.context, "context")?,
                        Arg::F32(log2_theta),
                    ],
                )?;
                g.launch(
                    flash(tiling)?,
                    (s.heads, longest.div_ceil(tiling.rows_per_block()), count),
                    FLASH_PREFILL_THREADS,
                    tiling.shared_bytes(s.head_dim),
                    &[
                        Arg::Ptr(qkv),
                        int(qkv_dim, "qkv width")?,
                        int(s.heads, "heads")?,
                        int(s.kv_heads, "kv heads")?,
                        Arg::Ptr(g.addr(k, 0)),
                        Arg::Ptr(g.addr(v, 0)),
                        int(self.context, "context")?,
                        Arg::Ptr(descriptors),
                        Arg::Ptr(attn),
                        int(q_dim, "attention width")?,
                        Arg::F32(scale_log2),
                    ],
                )?;
            }
            g.gemm(
                hidden,
                rows,
                q_dim,
                wt(offsets.o),
                attn,
                q_dim,
                x,
                hidden,
                true,
            )?;
            self.rmsnorm(rows, x, wt(offsets.mlp_norm), x_norm)?;
            g.gemm(
                2 * mlp,
                rows,
                hidden,
                wt(offsets.gate_up),
                x_norm,
                hidden,
                gate_up,
                2 * mlp,
                false,
            )?;
            g.launch(
                &g.kernels.silu_mul,
                ((mlp / 8).div_ceil(256).max(1), rows, 1),
                256,
                0,
                &[
                    Arg::Ptr(gate_up),
                    Arg::Ptr(act),
                    int(mlp, "mlp")?,
                    Arg::Ptr(0),
                    int(hidden, "hidden")?,
                    Arg::F32(s.norm_eps as f32),
                ],
            )?;
            g.gemm(
                hidden,
                rows,
                mlp,
                wt(offsets.down),
                act,
                mlp,
                x,
                hidden,
                true,
            )?;
        }
        if emits == 0 {
            return Ok(());
        }
        let (head_x, head_norm, logits, next) = (
            g.addr(&b.head_x, 0),
            g.addr(&b.head_norm, 0),
            g.addr(&b.logits, 0),
            g.addr(&b.next, 0),
        );
        let emit = g.addr(&b.emit, 0);
        g.launch(
            &g.kernels.gather_rows,
            (emits, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(emit),
                Arg::Ptr(head_x),
                int(hidden, "hidden")?,
            ],
        )?;
        self.rmsnorm(emits, head_x, wt(self.layout.final_norm), head_norm)?;
        g.gemm(
            vocab,
            emits,
            hidden,
            wt(self.layout.lm_head),
            head_norm,
            hidden,
            logits,
            vocab,
            false,
        )?;
        g.launch(
            &g.kernels.argmax,
            (emits, 1, 1),
            1024,
            0,
            &[Arg::Ptr(logits), int(vocab, "vocab")?, Arg::Ptr(next)],
        )?;
        g.launch(
            &g.kernels.scatter_tokens,
            (1, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(next),
                Arg::Ptr(emit + u64::from(emits) * 4),
                int(emits, "finished prompts")?,
                Arg::Ptr(g.addr(&self.buffers.tokens, 0)),
            ],
        )
    }

    /// Changes how later prefill calls tile their attention.
    pub fn set_prefill_attention(&mut self, tiling: PrefillAttention) {
        self.options.prefill_attention = tiling;
    }

    /// Waits for everything enqueued on the engine's stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.synchronize()
    }

    /// Checks a step's chunks (the first `decodes` of them decoding rows) against the
    /// engine; returns its rows.
    fn check_prefill(
        &self,
        chunks: &[PrefillChunk],
        decodes: u32,
        tokens: &[u32],
    ) -> Result<u32, CudaError> {
        if chunks.is_empty() {
            return Err(CudaError::Config(
                "a prefill call needs at least one chunk".into(),
            ));
        }
        let mut seen = vec![false; self.batch_max as usize];
        let mut rows = 0u64;
        for chunk in chunks {
            let Some(used) = seen.get_mut(chunk.slot as usize) else {
                return Err(CudaError::Config(format!(
                    "prefill slot {} is out of range: this engine has slots 0 to {}",
                    chunk.slot,
                    self.batch_max - 1
                )));
            };
            if std::mem::replace(used, true) {
                return Err(CudaError::Config(format!(
                    "slot {} appears twice in one prefill call: give each sequence one chunk per call",
                    chunk.slot
                )));
            }
            if chunk.len == 0 {
                return Err(CudaError::Config(format!(
                    "the prefill chunk of slot {} is empty",
                    chunk.slot
                )));
            }
            let end = u64::from(chunk.start) + u64::from(chunk.len);
            if end > u64::from(self.context) {
                return Err(CudaError::Config(format!(
                    "the prefill chunk of slot {} ends at position {end}, past the engine's context of {}: build the engine with a longer context",
                    chunk.slot, self.context
                )));
            }
            rows += u64::from(chunk.len);
        }
        if rows > u64::from(MAX_PREFILL_ROWS) {
            return Err(CudaError::Config(format!(
                "a prefill call of {rows} tokens is over the {MAX_PREFILL_ROWS} one call takes: split it into chunks"
            )));
        }
        let prompt_rows = rows - u64::from(decodes);
        if tokens.len() as u64 != prompt_rows {
            return Err(CudaError::Config(format!(
                "prompt chunks of {prompt_rows} tokens were given {} token ids",
                tokens.len()
            )));
        }
        Ok(rows as u32)
    }

    fn ensure_prefill_buffers(&mut self, rows: u32, chunks: u32) -> Result<(), CudaError> {
        if let Some(b) = &self.prefill_buffers
            && b.rows >= rows
            && b.chunks >= chunks
        {
            return Ok(());
        }
        let (rows, chunks) = match &self.prefill_buffers {
            Some(b) => (rows.max(b.rows), chunks.max(b.chunks)),
            None => (rows, chunks),
        };
        // Free the old set first: the new one may only fit without it.
        self.prefill_buffers = None;
        let s = &self.shape;
        let g = &self.gpu;
        let r = u64::from(rows);
        let c = u64::from(chunks);
        self.prefill_buffers = Some(PrefillBuffers {
            rows,
            chunks,
            tokens: g.alloc("the prompt token ids", r)?,
            x: g.alloc("the prefill residual stream", r * u64::from(s.hidden))?,
            x_norm: g.alloc("the prefill normalised residual", r * u64::from(s.hidden))?,
            sumsq: g.alloc("the prefill norm statistics", r)?,
            qkv: g.alloc("the prefill QKV activations", r * u64::from(s.qkv_dim()))?,
            attn: g.alloc("the prefill attention output", r * u64::from(s.q_dim()))?,
            gate_up: g.alloc("the prefill gate/up activations", r * 2 * u64::from(s.mlp))?,
            act: g.alloc("the prefill MLP activations", r * u64::from(s.mlp))?,
            descriptors: g.alloc("the prefill chunk descriptors", c * DESCRIPTOR_INTS as u64)?,
            emit: g.alloc("the finished prompts' rows and slots", 2 * c)?,
            decode_pairs: g.alloc("the decoding rows' slots", 2 * c)?,
            head_x: g.alloc("the finished prompts' last rows", c * u64::from(s.hidden))?,
            head_norm: g.alloc(
                "the finished prompts' normalised rows",
                c * u64::from(s.hidden),
            )?,
            logits: g.alloc("the prefill logits", c * u64::from(s.vocab))?,
            next: g.alloc("the first generated tokens", c)?,
        });
        Ok(())
    }

    /// The logits of the last prefill call's finished prompts, in chunk order.
    #[cfg(test)]
    pub(crate) fn prefill_logits(&self, finished: usize) -> Result<Vec<u16>, CudaError> {
        let b = self
            .prefill_buffers
            .as_ref()
            .ok_or_else(|| CudaError::Config("no prefill has run".into()))?;
        self.gpu
            .download(&b.logits, finished * self.shape.vocab as usize)
    }

    /// The QKV rows of the last prefill call's last layer (queries after RoPE), `rows` rows.
    #[cfg(test)]
    pub(crate) fn prefill_qkv(&self, rows: usize) -> Result<Vec<u16>, CudaError> {
        let b = self
            .prefill_buffers
            .as_ref()
            .ok_or_else(|| CudaError::Config("no prefill has run".into()))?;
        self.gpu
            .download(&b.qkv, rows * self.shape.qkv_dim() as usize)
    }

    /// Layer `layer`'s whole key and value caches, `[slot][kv head][position][head_dim]`.
    #[cfg(test)]
    pub(crate) fn kv_cache(&self, layer: usize) -> Result<(Vec<u16>, Vec<u16>), CudaError> {
        let (Some(k), Some(v)) = (self.k_cache.get(layer), self.v_cache.get(layer)) else {
            return Err(CudaError::Config(format!("layer {layer} has no KV cache")));
        };
        Ok((
            self.gpu.download(k, k.len())?,
            self.gpu.download(v, v.len())?,
        ))
    }

    /// The attention output of the last prefill call's last layer, `rows` rows.
    #[cfg(test)]
    pub(crate) fn prefill_attention(&self, rows: usize) -> Result<Vec<u16>, CudaError> {
        let b = self
            .prefill_buffers
            .as_ref()
            .ok_or_else(|| CudaError::Config("no prefill has run".into()))?;
        self.gpu
            .download(&b.attn, rows * self.shape.q_dim() as usize)
    }
}

fn to_i32(value: u32) -> Result<i32, CudaError> {
    i32::try_from(value)
        .map_err(|_| CudaError::Config(format!("{value} does not fit a 32-bit kernel argument")))
}
