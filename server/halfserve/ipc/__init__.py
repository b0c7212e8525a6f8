"""How the server's processes talk: frames and shared memory, the same for front-ends and instance processes."""
