"""What the layers compute beyond HF's: attention, experts and mixture-of-experts, the chunked LM head and loss,
labels, documents."""
