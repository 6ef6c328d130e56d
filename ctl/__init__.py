"""ddpjob's command line: render, submit and run job specs. Never imports torch at module level."""
