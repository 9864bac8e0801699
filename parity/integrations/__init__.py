"""parity inside other RL frameworks. Each integration imports its framework lazily: `import
parity` never needs them installed."""
