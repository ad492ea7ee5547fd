"""omnistage.bench"""
