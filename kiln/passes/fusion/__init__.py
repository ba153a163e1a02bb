"""kiln's fusion passes, one per file: each turns a sequence of kiln ops into one fused kiln op."""
