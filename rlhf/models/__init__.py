"""Model families, Megatron GPTModel builders and HF <-> Megatron mapping."""
