"""KV-cache memory: paged block pools with ref counts, hashed-block and radix prefix caches."""
