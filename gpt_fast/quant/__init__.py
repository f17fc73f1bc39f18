"""Weight-only int8 and int4: schemes, on-disk layout, the quantized layers and their products, GPTQ."""
