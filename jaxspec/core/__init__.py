"""The floor every room stands on: the configs (`config`), argument checks (`checks`), the bounded
cache of compiled programs (`programs`), how speed is measured (`measure`) and the GPU program
exported and inspected from any host (`gpu_export`). Nothing here imports the model."""
