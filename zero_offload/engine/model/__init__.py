"""The user's module as the engine sees it: built from the meta device and weight files.

`weights_files` reads weights (safetensors, torch files, Hugging Face indexes, any `WeightSource`);
`meta_buffers` computes the buffers a constructor would; `materialize` gives a meta-built module
its tensors; `attributes` finds where each parameter is bound (module and attribute name) so the
engine can rebind it. Imports only layers below the engine.
"""
