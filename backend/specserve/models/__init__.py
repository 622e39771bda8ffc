"""The target model in plain torch: weights, KV cache, attention backends, CPU linears."""
