"""CAPO: advantages, regularisers and PPO surrogates (losses), and task rewards (rewards)."""
