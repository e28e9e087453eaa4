"""`kestrel bench` and `kestrel launch`: measure any OpenAI-compatible server, start and watch servers."""
