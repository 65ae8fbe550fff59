"""Checkpoints in and out of hybridlm: read DeepSpeed's files offline, reshape them to another
parallel layout, export to and import from Hugging Face, and generate text.

    layout.py     what a checkpoint folder is: its layout, its model, safe file loading
    reader.py     full tensors (weights, fp32 master, Adam moments) from DeepSpeed's files of any layout
    reshape.py    load a checkpoint of one layout into a running engine of another
    experts.py    every EP rank's expert weights saved beside DeepSpeed's files (which keep EP rank 0's)
    writer.py     write full tensors as a checkpoint at a chosen TP/PP/EP (weights only)
    hf_names.py   our parameter names and config <-> Llama / Mixtral / GPT-2 / Mistral / Qwen2
    export.py     checkpoint -> Hugging Face directory (sharded safetensors, config, tokenizer)
    import_.py    Hugging Face directory -> checkpoint
    tokenizer_files.py  tokenizer files for an export
    generate.py   greedy / top-k / top-p decoding with a KV cache under TP (and scripts/generate.py's body)

Every tensor is addressed by its layout-independent parameter name (``hybridlm.model.specs``)
and assembled or split with the ``tp_sharding`` / ``ep_sharding`` tags the parallel layers put
on each parameter, so the code here never hard-codes how a layer is split.
"""
