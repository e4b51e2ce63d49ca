#!/usr/bin/env python3
"""Write a random-weight Llama-shaped GGUF for llama.cpp's server, with the llama-3 BPE
tokenizer copied from a vocab-only GGUF, using the gguf-py that ships in the same llama.cpp
tree (so the file matches what that server reads).

    make_model.py --gguf-py DIR --vocab VOCAB.gguf --out MODEL.gguf [--layers N] [--shape S]

--shape llama-3-8b (default): hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, f16,
  ~0.9 GB per layer plus 2.1 GB of embeddings (4 layers: 3.9 GB). For the GPU check.
--shape tiny: hidden 32, one head, MLP 64, output tied to the embeddings: ~8 MB, for the CPU
  test; it serves tokens at the speed a test wants, and its text is noise, as is the big one's.

The weights are random (seeded): what is measured is the engine's work and its counters, not
what it writes. Needs numpy and pyyaml (gguf-py imports both).
"""

import argparse
import sys
import time

SHAPES = {
    # hidden, MLP, query heads, KV heads, head dim, separate output matrix
    "llama-3-8b": (4096, 14336, 32, 8, 128, True),
    "tiny": (32, 64, 1, 1, 32, False),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf-py", required=True, help="the llama.cpp tree's gguf-py folder")
    parser.add_argument("--vocab", required=True, help="models/ggml-vocab-llama-bpe.gguf")
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    parser.add_argument("--context", type=int, default=8192, help="the model's trained context")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers {args.layers}: a model needs at least one layer")

    sys.path.insert(0, args.gguf_py)
    try:
        import numpy as np
        import gguf
    except ImportError as e:
        sys.exit(f"make_model.py needs numpy and pyyaml for gguf-py ({e}): pip install numpy pyyaml")

    hidden, mlp, heads, kv_heads, head_dim, own_output = SHAPES[args.shape]
    started = time.monotonic()
    vocab_file = gguf.GGUFReader(args.vocab)
    writer = gguf.GGUFWriter(args.out, "llama")
    vocab_size = None
    for name, field in vocab_file.fields.items():
        # Only the tokenizer: the vocab-only file's architecture keys describe no weights.
        if not name.startswith("tokenizer."):
            continue
        value_type = field.types[0]
        value = field.contents()
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
            if name == "tokenizer.ggml.tokens":
                vocab_size = len(value)
        else:
            writer.add_key_value(name, value, value_type)
    if vocab_size is None:
        sys.exit(f"{args.vocab} has no tokenizer.ggml.tokens: pass a vocab GGUF such as ggml-vocab-llama-bpe.gguf")

    writer.add_block_count(args.layers)
    writer.add_context_length(args.context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(mlp)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(vocab_size)

    rng = np.random.default_rng(0)

    def weights(rows, cols):
        # Small, so activations stay finite through the layers; f16 as the real model's.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def norm():
        return np.ones(hidden, np.float32)

    writer.add_tensor("token_embd.weight", weights(vocab_size, hidden))
    writer.add_tensor("output_norm.weight", norm())
    if own_output:
        # Without it llama.cpp ties the output to the embeddings (the tiny shape does).
        writer.add_tensor("output.weight", weights(vocab_size, hidden))
    for layer in range(args.layers):
        block = f"blk.{layer}."
        writer.add_tensor(block + "attn_norm.weight", norm())
        writer.add_tensor(block + "ffn_norm.weight", norm())
        writer.add_tensor(block + "attn_q.weight", weights(heads * head_dim, hidden))
        writer.add_tensor(block + "attn_k.weight", weights(kv_heads * head_dim, hidden))
        writer.add_tensor(block + "attn_v.weight", weights(kv_heads * head_dim, hidden))
        writer.add_tensor(block + "attn_output.weight", weights(hidden, heads * head_dim))
        writer.add_tensor(block + "ffn_gate.weight", weights(mlp, hidden))
        writer.add_tensor(block + "ffn_up.weight", weights(mlp, hidden))
        writer.add_tensor(block + "ffn_down.weight", weights(hidden, mlp))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(
        f"wrote {args.out}: {args.shape}, {args.layers} layers, vocab {vocab_size}, "
        f"in {time.monotonic() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
