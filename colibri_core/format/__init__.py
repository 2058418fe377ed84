"""The files: the quantized weight formats (quant), whole-file mappings (filemap), the
container format (modelfile, docs/FORMAT.md) and the value checks on stored weights
(validate). Imports nothing above the base modules."""
