"""Array math shared by the layers and the Pallas kernels: norms, rotary embedding, compressor
pooling. Imports nothing from jaxspec but `config`."""
