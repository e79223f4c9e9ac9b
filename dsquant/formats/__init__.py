"""Weight formats: one module per layout dsquant reads and writes, and one quantization_config parser.

Used by both sides (export writes, runtime / models read), so nothing here imports any of dsquant
but dsquant.errors. Each format module states its tensor layout and holds its pack/unpack, its
expected tensor names and shapes, and its quantization_config as a frozen dataclass
(`from_dict` validates a reader's config, `to_dict` is the dict every writer emits):

  int_grid.py            the integer group grid and the nibble packing the INT4 formats share
  awq_gemm.py            AutoAWQ "gemm": qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]  AwqConfig
  gptq.py                GPTQ v1 / v2: qweight [K/8, N], qzeros [K/G, N/8], scales, g_idx [K]  GptqConfig
  fp8_block.py           DeepSeek-V3 FP8: weight e4m3 [N, K], weight_scale_inv [N/128, K/128]  Fp8BlockConfig
  compressed_tensors.py  llm-compressor pack-quantized INT4 / float-quantized FP8 groups       CompressedTensorsConfig
  int4_check.py          AWQ / GPTQ tensor shapes checked against the parsed config
  quantization_config.py parse_quantization_config (config.json, AutoAWQ / AutoGPTQ side files)

A parsed config answers `scheme_for(module name)`: the scheme that module is stored in, or None
where it stays dense; the runtime's LinearFactory maps that scheme to its method object.
"""
from dsquant.formats.awq_gemm import AwqConfig
from dsquant.formats.compressed_tensors import CompressedTensorsConfig, CTFp8Scheme, CTInt4Scheme
from dsquant.formats.fp8_block import Fp8BlockConfig
from dsquant.formats.gptq import GptqConfig
from dsquant.formats.quantization_config import QuantFormat, parse_quantization_config

__all__ = ["AwqConfig", "CTFp8Scheme", "CTInt4Scheme", "CompressedTensorsConfig", "Fp8BlockConfig", "GptqConfig",
           "QuantFormat", "parse_quantization_config"]
