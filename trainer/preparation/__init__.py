"""The parts of data preparation (trainer.prepare is its entry): plan, readers, encode, progress, build."""
