"""Models from the Hugging Face Hub: plans from their headers, downloads into the cache the engines
read, and what that cache holds. huggingface_hub does the protocol, the range reads, the resumable
downloads and the cache's layout; this package decides what to fetch, checks the disk, and reports."""
