"""Picking each request's next token on the device: penalties, warpers, seeded sampling, logprobs."""
