"""omnistage.kernels"""
